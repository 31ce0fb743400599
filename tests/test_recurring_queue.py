"""Background compiles of recurring runs and first-sighting units wait in a bounded FIFO queue
for one of ``matching.compiles_in_flight`` slots instead of being dropped (issue 44: a burst of
RAG prompts lost its documents' reuse, 4 of 7 scheduled compiles ``skipped_busy`` at low load).
Only a full queue (``matching.compile_queue``) skips; the same run queued twice is compiled once
(the second ends ``cached``); every scheduled compile ends exactly once, so ``pending()`` returns
to 0, also when the event loop closes with compiles in the gate and in the queue. A fake gate
(no cluster, no model) holds the compiles until the test opens it."""
import asyncio
from dataclasses import replace

import pytest

from cluster.control.fingerprints import cut
from cluster.control.matching import MatchConfig
from cluster.control.metrics import Metrics
from cluster.control.recurring import OUTCOMES, RecurringSpans, pending
from cluster.control.state import open_state
from kvruntime.config import ClusterConfig
from kvruntime.messages.plan import KVRef
from tests.conftest import metric
from tests.test_fast_exact_first import BREAK, SALT, _text, ids


class _Gate:
    """The background gate: a compile waits in it until ``open`` is set; how many wait at once."""

    def __init__(self, held=()):
        self.open: asyncio.Event | None = None
        self.now = self.most = 0
        self.compiled: list[tuple[int, ...]] = []
        self.held = set(held)                       # digests the tier holds already

    async def precompile(self, ref, index, base=None):
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            await self.open.wait()
            self.compiled.append(ref.token_ids)
            return type("Info", (), {"cached": ref.digest in self.held, "seconds": 0.0})()
        finally:
            self.now -= 1


def _spans(tmp_path, gate, **cfg):
    metrics = Metrics()
    rs = RecurringSpans(open_state(f"sqlite:///{tmp_path}/s.db"), gate, metrics, replace(MatchConfig(), **cfg), 1,
                        text=_text, background=gate)
    return rs, metrics


def _outcomes(metrics):
    text = metrics.render().decode()
    return {o: metric(text, "kvnotes_recurring_spans_total", outcome=o) for o in OUTCOMES}


async def _observe(rs, key, prompt):
    await rs.observe("t", SALT, key, prompt, cut("t", prompt), {}, [], 0, units_at=[(0, len(prompt))])


async def _settle():
    for _ in range(50):                             # let every task run up to where it waits
        await asyncio.sleep(0)


DOCS = [ids(100 + i, 200) for i in range(5)]        # five first-sighting documents, one prompt each


def test_a_burst_of_five_with_two_slots_all_compile_in_order_none_skipped(tmp_path):
    gate = _Gate()
    rs, metrics = _spans(tmp_path, gate, compiles_in_flight=2)

    async def go():
        gate.open = asyncio.Event()
        for i, doc in enumerate(DOCS):
            await _observe(rs, f"k{i}", doc)
        await _settle()
        got = _outcomes(metrics)
        assert got["scheduled"] == 5 and pending(got) == 5 and got["skipped_busy"] == 0, got
        assert gate.now == 2 and len(rs._queue) == 3      # two wait in the gate holding the slots, three queued
        gate.open.set()
        await rs.drain()
    asyncio.run(go())
    got = _outcomes(metrics)
    assert got["compiled"] == 5 and got["skipped_busy"] == 0 and pending(got) == 0, got
    assert gate.compiled == DOCS and gate.most == 2                # first in, first out; never more than 2
    assert rs.in_flight == 0 and not rs._queue and not rs._digests


def test_only_a_full_queue_skips(tmp_path):
    gate = _Gate()
    rs, metrics = _spans(tmp_path, gate, compiles_in_flight=2, compile_queue=1)

    async def go():
        gate.open = asyncio.Event()
        for i, doc in enumerate(DOCS):
            await _observe(rs, f"k{i}", doc)
        await _settle()
        got = _outcomes(metrics)
        assert got["skipped_busy"] == 2 and pending(got) == 3, got        # 2 slots + 1 queued; the last two
        gate.open.set()
        await rs.drain()
    asyncio.run(go())
    got = _outcomes(metrics)
    assert got["compiled"] == 3 and got["skipped_busy"] == 2 and pending(got) == 0, got
    assert gate.compiled == DOCS[:3]


def test_no_slots_skips_every_compile(tmp_path):
    gate = _Gate()
    rs, metrics = _spans(tmp_path, gate, compiles_in_flight=0)

    async def go():
        gate.open = asyncio.Event()
        await _observe(rs, "k0", DOCS[0])
        await rs.drain()
    asyncio.run(go())
    got = _outcomes(metrics)
    assert got["skipped_busy"] == 1 and pending(got) == 0 and gate.compiled == [], got


def test_the_same_run_queued_twice_is_compiled_once_and_a_held_one_ends_cached(tmp_path):
    gate = _Gate()
    rs, metrics = _spans(tmp_path, gate, compiles_in_flight=1)

    async def go():
        gate.open = asyncio.Event()
        # a prompt pasting two documents twice: the first in the gate, the second queued, the repeats
        # of the same runs not queued again
        await _observe(rs, "k0", DOCS[0] + (BREAK,) + DOCS[1] + (BREAK,) + DOCS[0] + (BREAK,) + DOCS[1])
        await _settle()
        got = _outcomes(metrics)
        assert got["scheduled"] == 4 and got["cached"] == 2 and pending(got) == 2, got
        gate.open.set()
        await rs.drain()
    asyncio.run(go())
    got = _outcomes(metrics)
    assert gate.compiled == DOCS[:2] and got["compiled"] == 2 and got["cached"] == 2 and pending(got) == 0, got

    held = _Gate(held={KVRef(DOCS[2], 1, SALT).digest})
    (tmp_path / "b").mkdir()
    rs, metrics = _spans(tmp_path / "b", held)

    async def again():
        held.open = asyncio.Event()
        held.open.set()
        await _observe(rs, "k2", DOCS[2])
        await rs.drain()
    asyncio.run(again())
    got = _outcomes(metrics)
    assert got["cached"] == 1 and got["compiled"] == 0 and pending(got) == 0, got


def test_a_closing_loop_ends_every_compile_failed_in_the_gate_or_queued(tmp_path):
    gate = _Gate()
    rs, metrics = _spans(tmp_path, gate, compiles_in_flight=2)

    async def closing():
        gate.open = asyncio.Event()                 # never set: the loop closes with them waiting
        for i, doc in enumerate(DOCS):
            await _observe(rs, f"k{i}", doc)
        await _settle()
        assert gate.now == 2 and pending(_outcomes(metrics)) == 5      # two in the gate, three queued
    asyncio.run(closing())                          # asyncio.run cancels the tasks it leaves
    got = _outcomes(metrics)
    assert got["scheduled"] == 5 and got["failed"] == 5 and got["skipped_busy"] == 0 and pending(got) == 0, got
    assert rs.in_flight == 0 and not rs._queue and not rs._digests and gate.compiled == []

    async def next_loop():                          # the slots are free again in the next loop
        gate.open = asyncio.Event()
        gate.open.set()
        await _observe(rs, "k9", ids(99, 200))
        await rs.drain()
    asyncio.run(next_loop())
    got = _outcomes(metrics)
    assert got["compiled"] == 1 and pending(got) == 0, got


def test_a_cancelled_queued_compile_hands_no_slot_and_the_next_one_still_runs(tmp_path):
    gate = _Gate()
    rs, metrics = _spans(tmp_path, gate, compiles_in_flight=1)

    async def go():
        gate.open = asyncio.Event()
        before = set()
        tasks = []
        for i, doc in enumerate(DOCS[:3]):
            await _observe(rs, f"k{i}", doc)
            tasks += list(rs._tasks - before)
            before = set(rs._tasks)
        await _settle()
        tasks[1].cancel()                           # the first queued one
        await _settle()
        assert gate.now == 1 and pending(_outcomes(metrics)) == 2
        gate.open.set()
        await rs.drain()
    asyncio.run(go())
    got = _outcomes(metrics)
    assert got["compiled"] == 2 and got["failed"] == 1 and pending(got) == 0, got
    assert gate.compiled == [DOCS[0], DOCS[2]]


def test_compile_queue_is_validated_and_read_from_the_config():
    assert MatchConfig().compile_queue == 16
    assert ClusterConfig.of(matching_compile_queue=4).matching.compile_queue == 4
    for bad in (-1, "3", True, 2.0):
        with pytest.raises(ValueError, match="matching.compile_queue"):
            MatchConfig(compile_queue=bad)
