"""The Responses store's bounds are config keys (``response_ttl_s``, ``response_max`` in the
``state`` section): flat or nested in a config file, checked (a ValueError naming the key), and
what the state store the router opens enforces (``StateConfig.store_limits``)."""
import pytest

from cluster.control.state import StoreLimits, open_state
from kvruntime.config import ClusterConfig


def test_defaults_and_both_key_forms():
    d = ClusterConfig.of().state
    assert (d.response_ttl_s, d.response_max) == (7 * 86400.0, 20_000)
    flat = ClusterConfig.from_dict({"response_ttl_s": 60, "response_max": 5}).state
    nested = ClusterConfig.from_dict({"state": {"response_ttl_s": 60, "response_max": 5}}).state
    assert (flat.response_ttl_s, flat.response_max) == (nested.response_ttl_s, nested.response_max) == (60, 5)


@pytest.mark.parametrize("key,value", [("response_ttl_s", 0), ("response_ttl_s", -1.0), ("response_ttl_s", "7d"),
                                       ("response_ttl_s", float("inf")), ("response_max", 0),
                                       ("response_max", 2.5), ("response_max", True)])
def test_bad_values_are_refused_naming_the_key(key, value):
    with pytest.raises(ValueError, match=key):
        ClusterConfig.of(**{key: value})


def test_the_store_enforces_the_configured_bounds(tmp_path):
    cfg = ClusterConfig.of(response_ttl_s=100, response_max=2, session_ttl_s=50, prompt_index_max=7)
    limits = StoreLimits(**cfg.state.store_limits())
    assert (limits.response_ttl_s, limits.response_max, limits.session_ttl_s, limits.prompt_max) == (100, 2, 50, 7)
    s = open_state(f"sqlite:///{tmp_path}/state.db", limits)
    s.put_response("acme", "resp_a", '"a"', 1000.0)
    assert s.get_response("acme", "resp_a", 1099.0) == '"a"' and s.get_response("acme", "resp_a", 1101.0) is None
    for i in range(3):                                  # the third drops the oldest: at most two kept
        s.put_response("acme", f"resp_{i}", f'"{i}"', 2000.0 + i)
    assert [s.get_response("acme", f"resp_{i}", 2010.0) for i in range(3)] == [None, '"1"', '"2"']
