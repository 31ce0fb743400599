"""A client can tell that its own prompt's store behind has landed, not an earlier prompt's: each
compile queued is counted as ``kvnotes_prompt_stores_total{outcome="scheduled"}`` and ends as one
of ``stored``, ``stored_delta``, ``cached``, ``failed`` (``store_behind.pending``: the difference).
Without it a wait for "one more store" was met by a store an earlier prompt had queued, and the
prompt sent next found its held prompt not in the tier (test_e2e_vllm_prompt_match's balanced test,
after the module's growing conversation had queued its turns' stores)."""
import asyncio

from cluster.control.metrics import Metrics
from cluster.control.store_behind import OUTCOMES, StoreBehind, StoreBehindConfig, pending
from kvruntime.messages.plan import KVRef
from kvruntime.messages.prefill import PrecompileInfo
from tests.conftest import metric
from tests.test_store_behind import SALT, _Backends, _Index


def _counts(m: Metrics) -> dict[str, float]:
    text = m.render().decode()
    return {o: metric(text, "kvnotes_prompt_stores_total", outcome=o) for o in OUTCOMES}


def _refs(n: int) -> list[KVRef]:
    return [KVRef(tuple(range(k, k + 600)), 0, SALT) for k in range(n)]


def test_a_queued_store_is_pending_until_it_ends_and_skips_never_are():
    async def go():
        gate = asyncio.Event()
        m = Metrics()
        sb = StoreBehind(_Backends(gate=gate), m, _Index(), StoreBehindConfig(in_flight=1, queue=1))
        assert 'kvnotes_prompt_stores_total{outcome="scheduled"} 0.0' in m.render().decode()   # exported from 0
        earlier, mine, late = _refs(3)
        assert [sb.schedule("t", earlier, 0, 0), sb.schedule("t", mine, 0, 0), sb.schedule("t", late, 0, 0),
                sb.schedule("t", mine, 0, 0)] == ["scheduled", "scheduled", "skipped_busy", "skipped_duplicate"]
        await asyncio.sleep(0.1)
        counts = _counts(m)
        assert counts["scheduled"] == 2 and pending(counts) == 2, counts     # the skipped ones are not pending
        gate.set()
        await sb.drain()
        counts = _counts(m)
        assert counts["stored"] == 2 and pending(counts) == 0, counts
    asyncio.run(go())


class _Second(_Backends):
    """Compiles the first store at once and holds every later one until ``gate`` is set."""
    async def precompile(self, ref, index=0, base=None):
        if self.refs:
            await self.gate.wait()
        self.refs.append(ref)
        return PrecompileInfo(False, 1, 0.01, "prefill-0", 0)


def test_one_more_store_is_not_this_prompts_store_while_any_is_pending():
    # an earlier prompt's store lands first: the stored count has risen by one (the old wait passed
    # there), yet this prompt's store is still queued; pending says so
    async def go():
        m, gate = Metrics(), asyncio.Event()
        backends = _Second(gate=gate)
        sb = StoreBehind(backends, m, _Index(), StoreBehindConfig(in_flight=1, queue=4))
        earlier, mine = _refs(2)
        before = _counts(m)
        assert sb.schedule("t", earlier, 0, 0) == sb.schedule("t", mine, 0, 0) == "scheduled"
        for _ in range(1000):                                           # bounded: a hang is a failure below
            if _counts(m)["stored"] > before["stored"]:
                break
            await asyncio.sleep(0.01)
        counts = _counts(m)
        assert counts["stored"] == before["stored"] + 1 and pending(counts) == 1, counts
        assert backends.refs == [earlier]                               # not this prompt's
        gate.set()
        await sb.drain()
        assert pending(_counts(m)) == 0 and backends.refs == [earlier, mine]
    asyncio.run(go())


def test_a_failed_store_ends_too():
    async def go():
        m = Metrics()
        sb = StoreBehind(_Backends(fail=True), m, _Index())
        assert sb.schedule("t", _refs(1)[0], 0, 0) == "scheduled"
        await sb.drain()
        counts = _counts(m)
        assert counts["failed"] == 1 and pending(counts) == 0, counts
    asyncio.run(go())
