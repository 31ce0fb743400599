"""Background compiles (store-behind, recurring spans and units) yield to this replica's requests
(``cluster.control.backends.YieldingBackends``): pure asyncio, a recording fake in place of the
workers (the gate's own logic; the router builds one gate around the shipped backends for both
store-behind and the matcher's recurring compiles, last test)."""
import asyncio

import pytest

from cluster.control.backends import RequestActivity, YieldConfig, YieldingBackends
from cluster.control.metrics import Metrics
from kvruntime.messages.plan import KVRef
from kvruntime.messages.prefill import PrecompileInfo
from tests.conftest import metric


class Recording:
    def __init__(self):
        self.calls = []

    async def precompile(self, ref, index=0, base=None):
        self.calls.append((ref, index, base))
        return PrecompileInfo(False, 0, 0.0, "local")

    async def contains(self, refs, index=0):
        return [False] * len(refs)


REF = KVRef((1, 2, 3), 0, "salt")


def fallbacks(m: Metrics, reason: str) -> float:
    return metric(m.render().decode(), "kvnotes_fallbacks_total", reason=reason)


async def _spin(n=20):
    for _ in range(n):
        await asyncio.sleep(0.001)


def test_a_compile_waits_for_a_request_that_started_after_it_was_asked_for():
    async def go():
        act, inner, m = RequestActivity(), Recording(), Metrics()
        gate = YieldingBackends(inner, act, YieldConfig(quiet_s=0.01, max_wait_s=60), m)
        with act.request():                      # the request whose answer asked for the store
            task = asyncio.ensure_future(gate.precompile(REF, 1, base=None))
            await _spin()
        cm = act.request()                       # the client's next request arrives
        cm.__enter__()
        await _spin(50)
        assert inner.calls == [], "a background compile started while a request was in flight"
        cm.__exit__(None, None, None)
        info = await task
        assert inner.calls == [(REF, 1, None)] and not info.cached
        assert fallbacks(m, "background_deferred") == 1 and fallbacks(m, "background_deferral_expired") == 0
        assert await gate.yield_to_requests() == "ran"                # quiet: no wait, nothing counted
        assert fallbacks(m, "background_deferred") == 1
        assert await gate.contains([REF]) == [False]                  # everything else is the backends' own
    asyncio.run(go())


def test_a_compile_stops_waiting_at_max_wait_and_runs_counted():
    async def go():
        act, inner, m = RequestActivity(), Recording(), Metrics()
        gate = YieldingBackends(inner, act, YieldConfig(quiet_s=10, max_wait_s=0.05), m)
        with act.request():                      # requests never pause
            await gate.precompile(REF)
        assert len(inner.calls) == 1 and fallbacks(m, "background_deferral_expired") == 1
    asyncio.run(go())


def test_off_runs_at_once_and_bad_settings_are_refused():
    async def go():
        act, inner, m = RequestActivity(), Recording(), Metrics()
        gate = YieldingBackends(inner, act, YieldConfig(quiet_s=0), m)
        with act.request():
            assert await gate.yield_to_requests() == "off"
            await gate.precompile(REF)
        assert len(inner.calls) == 1
    asyncio.run(go())
    with pytest.raises(ValueError, match="quiet_s and max_wait_s"):
        YieldConfig(quiet_s=-1)


def test_a_registrations_core_does_not_wait_for_requests_but_a_recurring_compile_does(tmp_path):
    """The matcher's recurring spans compile through the gate; a registration's core (its call
    waits on it) goes straight to the workers, requests in flight or not."""
    from cluster.control.prompt_match import PromptMatcher
    from cluster.control.state import open_state

    async def go():
        act, inner, m = RequestActivity(), Recording(), Metrics()
        gate = YieldingBackends(inner, act, YieldConfig(quiet_s=10, max_wait_s=600), m)
        matcher = PromptMatcher(open_state(f"sqlite:///{tmp_path}/s.db"), inner, m, None, 0,
                                decode=lambda ids: "\n\n" if ids[0] == 9 else "w", background=gate)
        assert matcher.recurring.background is gate and matcher.backends is inner
        ids = tuple(range(100, 200)) + (9,)
        with act.request():
            await asyncio.wait_for(matcher.index_registration("t", "skill", "s", ids, "salt", 0), 5)
            assert [c[0].token_ids for c in inner.calls] == [ids[:-1]]        # the core, compiled at once
            matcher.recurring._schedule("t", "salt", tuple(range(300, 400)), 0)     # one background compile
            task, = matcher.recurring._tasks
            await _spin()
            assert len(inner.calls) == 1, "a recurring compile started while a request was in flight"
            task.cancel()
    asyncio.run(go())


def test_the_router_builds_one_gate_for_store_behind_and_recurring_spans(smol, tmp_path):
    from cluster.control.router_sections import PolicySection
    from cluster.control.state import open_state
    from tests.test_prompt_reuse import ReuseBackends
    from tests.test_router_fallback import ModelSection, Registry, Renderer, Router

    b, state = ReuseBackends(smol), open_state(f"sqlite:///{tmp_path / 'state.db'}")
    try:
        router = Router(b, Renderer(smol.tokenizer, smol.spec, Registry(state), smol.bos_id), state,
                        ModelSection("m", "float32"), metrics=Metrics(),
                        policy=PolicySection(background_yield=YieldConfig(quiet_s=0.25, max_wait_s=7)))
        gate = router.background
        assert isinstance(gate, YieldingBackends) and gate.cfg == YieldConfig(quiet_s=0.25, max_wait_s=7)
        assert router.streams.store_behind.backends is gate and router.matcher.recurring.background is gate
        assert router.streams.activity is gate.activity                 # the requests the streams count
        assert router.matcher.backends is b and router.runner.backends is b   # a request's build does not wait
    finally:
        b.rx.stop()
