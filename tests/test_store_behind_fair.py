"""The store-behind queue is shared by every tenant and every prompt of a router replica; one
tenant's traffic must not starve another's cold prompt (its one-field edit later finds nothing in
the tier):
- a growing conversation queues one store per turn, each prompt extending the previous: a new
  store supersedes a waiting (not yet compiling) store of the same tenant and salt that it extends
  (``outcome="superseded"``; the newer one covers it, continuing from the longest held prefix), so
  the conversation holds one waiting slot, not the whole queue;
- with the queue full, a tenant with fewer waiting stores takes the oldest waiting slot of the
  tenant holding the most (``outcome="displaced"``; ``when_full="displace"``, the default), until
  their shares are even; ``when_full="skip"``: the newcomer is skipped (``skipped_busy``).
Every scheduled store ends exactly once (``pending`` returns to 0)."""
import asyncio

import pytest

from cluster.control.metrics import Metrics
from cluster.control.store_behind import ENDS, OUTCOMES, StoreBehind, StoreBehindConfig, pending
from kvruntime.messages.plan import KVRef
from tests.test_store_behind import SALT, _Backends, _Index
from tests.test_store_behind_pending import _counts

OTHER_SALT = "o" * 32


def _turns(n: int, start: int = 0, salt: str = SALT) -> list[KVRef]:
    """A growing conversation: turn k's prompt is turn k-1's and 100 tokens more."""
    return [KVRef(tuple(range(start, start + 300 + 100 * k)), 0, salt) for k in range(n)]


def _cold(k: int, salt: str = SALT) -> KVRef:
    return KVRef(tuple(range(50_000 + 1000 * k, 50_000 + 1000 * k + 600)), 0, salt)


def _ends_once(counts: dict) -> None:
    assert counts["scheduled"] == sum(counts[o] for o in ENDS) and pending(counts) == 0, counts


def test_a_growing_conversation_holds_one_waiting_slot_and_a_cold_prompt_is_stored():
    async def go():
        gate, m = asyncio.Event(), Metrics()
        b = _Backends(gate=gate)
        sb = StoreBehind(b, m, _Index(), StoreBehindConfig(in_flight=1, queue=4))
        turns = _turns(7)
        got = [sb.schedule("talk", t, 0, 0) for t in turns]
        await asyncio.sleep(0)                                   # turn 0 starts compiling
        cold = _cold(0)
        got.append(sb.schedule("acme", cold, 0, 0))
        assert got == ["scheduled"] * 8, got                     # before: turns 5, 6 and the cold one skipped_busy
        counts = _counts(m)
        assert counts["superseded"] == 5 and pending(counts) == 3, counts   # turn 0 compiling, turn 6 + cold waiting
        gate.set()
        await sb.drain()
        assert b.refs == [turns[0], turns[6], cold]               # turns 1-5: covered by turn 6's store
        counts = _counts(m)
        assert counts["stored"] == 3 and counts["skipped_busy"] == 0, counts
        _ends_once(counts)
    asyncio.run(go())


def test_only_a_waiting_store_of_the_same_tenant_salt_and_worker_that_it_extends_is_superseded():
    async def go():
        gate, m = asyncio.Event(), Metrics()
        b = _Backends(gate=gate)
        sb = StoreBehind(b, m, _Index(), StoreBehindConfig(in_flight=1, queue=8))
        t = _turns(3)
        assert sb.schedule("talk", t[0], 0, 0) == "scheduled"
        await asyncio.sleep(0)                                   # compiling: never dropped
        waiting = [t[1],                                         # extended below by t[2] (same tenant, salt, worker)
                   KVRef(t[1].token_ids, 0, OTHER_SALT),         # another salt
                   KVRef(t[1].token_ids[:320], 0, SALT),         # a prefix too, but on worker 1 (below)
                   KVRef((7,) + t[1].token_ids[1:], 0, SALT)]    # not a prefix of t[2]
        assert [sb.schedule("talk", waiting[0], 0, 0), sb.schedule("talk", waiting[1], 0, 0),
                sb.schedule("talk", waiting[2], 0, 1), sb.schedule("talk", waiting[3], 0, 0),
                sb.schedule("other", KVRef(t[1].token_ids[:340], 0, SALT), 0, 0)] == ["scheduled"] * 5  # another tenant
        assert sb.schedule("talk", t[2], 0, 0) == "scheduled"
        assert _counts(m)["superseded"] == 1
        gate.set()
        await sb.drain()
        assert b.refs == [t[0], *waiting[1:], KVRef(t[1].token_ids[:340], 0, SALT), t[2]]  # first in, first out
        _ends_once(_counts(m))
    asyncio.run(go())


def test_a_full_queue_gives_a_tenant_with_nothing_queued_the_oldest_slot_of_the_one_holding_most():
    async def go():
        gate, m = asyncio.Event(), Metrics()
        b = _Backends(gate=gate)
        sb = StoreBehind(b, m, _Index(), StoreBehindConfig(in_flight=1, queue=4))
        a = [_cold(k) for k in range(6)]                          # one tenant's unrelated prompts (RAG, say)
        bb = [_cold(10 + k) for k in range(3)]
        got = [sb.schedule("a", a[0], 0, 0)]
        await asyncio.sleep(0)                                    # a[0] compiling; a[1..4] fill the queue
        got += [sb.schedule("a", r, 0, 0) for r in a[1:]]
        got += [sb.schedule("b", r, 0, 0) for r in bb]
        # a[5]: its tenant holds the most already; b[0], b[1] take a[1], a[2]'s slots; b[2]: even (2 and 2)
        assert got == ["scheduled"] * 5 + ["skipped_busy", "scheduled", "scheduled", "skipped_busy"], got
        counts = _counts(m)
        assert counts["displaced"] == 2 and pending(counts) == 5, counts
        gate.set()
        await sb.drain()
        assert b.refs == [a[0], a[3], a[4], bb[0], bb[1]]
        _ends_once(_counts(m))
    asyncio.run(go())


def test_when_full_skip_keeps_the_newcomer_out():
    async def go():
        gate, m = asyncio.Event(), Metrics()
        b = _Backends(gate=gate)
        sb = StoreBehind(b, m, _Index(), StoreBehindConfig(in_flight=1, queue=2, when_full="skip"))
        a = [_cold(k) for k in range(3)]
        got = [sb.schedule("a", r, 0, 0) for r in a] + [sb.schedule("b", _cold(9), 0, 0)]
        assert got == ["scheduled"] * 3 + ["skipped_busy"]
        gate.set()
        await sb.drain()
        assert b.refs == a and _counts(m)["displaced"] == 0
        _ends_once(_counts(m))
    asyncio.run(go())


def test_a_queue_of_zero_displaces_nothing_and_bad_settings_are_refused():
    async def go():
        gate, m = asyncio.Event(), Metrics()
        sb = StoreBehind(_Backends(gate=gate), m, _Index(), StoreBehindConfig(in_flight=1, queue=0))
        assert [sb.schedule("a", _cold(0), 0, 0), sb.schedule("b", _cold(1), 0, 0)] == ["scheduled", "skipped_busy"]
        gate.set()
        await sb.drain()
        _ends_once(_counts(m))
    asyncio.run(go())
    with pytest.raises(ValueError, match="when_full"):
        StoreBehindConfig(when_full="drop")
    assert {"superseded", "displaced"} <= set(ENDS) <= set(OUTCOMES)


def test_a_compile_cancelled_with_its_loop_ends_as_failed_and_a_store_left_waiting_runs_in_the_next():
    async def go(m):
        sb = StoreBehind(_Backends(gate=asyncio.Event()), m, _Index(), StoreBehindConfig(in_flight=1, queue=1))
        assert sb.schedule("a", _cold(0), 0, 0) == sb.schedule("a", _cold(1), 0, 0) == "scheduled"
        await asyncio.sleep(0)
        return sb                                                 # asyncio.run cancels the compile under way
    m = Metrics()
    sb = asyncio.run(go(m))
    counts = _counts(m)
    assert counts["failed"] == 1 and pending(counts) == 1, counts  # the waiting one is still queued
    sb.backends = _Backends()
    asyncio.run(sb.drain())                                       # (tests run many loops on one StoreBehind)
    assert sb.backends.refs == [_cold(1)]
    _ends_once(_counts(m))
