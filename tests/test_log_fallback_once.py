"""A fallback is logged once per process and reason (every occurrence is counted instead), by the
one helper the prefill executor and the transport endpoints share."""
import logging

from kvruntime.telemetry import log_fallback_once


def test_one_line_per_reason_naming_the_counter(caplog):
    lg = logging.getLogger("kvnotes.test.fallbacks")
    with caplog.at_level(logging.WARNING, logger="kvnotes.test.fallbacks"):
        for _ in range(3):
            log_fallback_once(lg, "test_reason_a", "thing %s failed: %r", "x", "y%s")
        log_fallback_once(lg, "test_reason_b", "other 100% failure")
    lines = [r.getMessage() for r in caplog.records if r.name == "kvnotes.test.fallbacks"]
    assert lines == ["thing x failed: 'y%s' (counted in kvnotes_fallbacks_total{reason=test_reason_a}; logged once)",
                     "other 100% failure (counted in kvnotes_fallbacks_total{reason=test_reason_b}; logged once)"]
