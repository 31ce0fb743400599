"""The plain-prompt request path on a decode engine that computes cold prompts itself (vLLM,
``decode_computes_cold``), in process (real SmolLM2, real SQLite; no Ray):

- a one-field change of a held prompt whose divergence is inside the held KV's first tier piece,
  under ``exact`` / ``balanced`` (the edit declined), reuses nothing from the tier: it runs no
  prefill worker (the record shape of bench.agent_traffic waited there behind the previous
  prompt's store-behind), its answer is a recompute's, and the declined edit is still counted;
- the state-store writes after a request run in a worker thread, never on the event loop."""
import asyncio
import threading

import pytest

from cluster.control.backends import YieldingBackends
from cluster.control.context import RequestContext
from cluster.control.router_sections import PolicySection
from cluster.control.state import open_state
from kvruntime.messages.decode import SamplingParams, TokenEvent
from tests.conftest import metric

pytestmark = pytest.mark.slow


def status_third(status: str) -> str:
    """A record whose third line changes (bench.agent_traffic_shapes.edited_record's form): the
    divergence is inside the first 256-token piece of the held prompt."""
    notes = [f"note {i}: parcel {i * 37 % 101} scanned at depot {i * 13 % 17} on schedule" for i in range(40)]
    return "\n".join(["Shipment record 4471", "Customer: Halden Freight Ltd", f"Status: {status}", *notes]) + "\n"


class ThreadRecordingState:
    """The real store, noting which thread each write ran on (delegates everything else)."""

    WRITES = ("put_prompt_blocks", "put_decode_held", "put_held_prompt", "put_fingerprints", "count_fingerprints")

    def __init__(self, inner):
        self._inner, self.writes = inner, []

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name not in self.WRITES:
            return attr

        def call(*a, **kw):
            self.writes.append((name, threading.current_thread()))
            return attr(*a, **kw)
        return call


@pytest.fixture
def cold(smol, tmp_path):
    from tests.test_prompt_reuse import ReuseBackends
    from tests.test_router_fallback import Metrics, ModelSection, Registry, Renderer, Router

    b = ReuseBackends(smol)
    state = ThreadRecordingState(open_state(f"sqlite:///{tmp_path / 'state.db'}"))
    router = Router(b, Renderer(smol.tokenizer, smol.spec, Registry(state), smol.bos_id), state,
                    ModelSection("m", "float32"), metrics=Metrics(), policy=PolicySection(decode_computes_cold=True))
    yield router, b, state
    b.rx.stop()


def ask(router, ids, policy, tenant="default"):
    async def go():
        toks, fin = [], None
        async for ev in router.stream_prompt(RequestContext.local(tenant, policy=policy), list(ids),
                                             sampling=SamplingParams(max_tokens=4, temperature=0)):
            if isinstance(ev, TokenEvent):
                toks.append(ev.token_id)
            else:
                fin = ev
        await router.matcher.recurring.drain()
        await router.streams.store_behind.drain()
        return toks, fin, threading.current_thread()
    return asyncio.run(go())


@pytest.mark.parametrize("policy", ["exact", "balanced"])
def test_a_declined_edit_diverging_in_the_first_piece_runs_no_prefill(smol, cold, policy):
    router, b, _ = cold
    q = smol.encode("What is the shipment status now?")
    p1, p2 = smol.encode(status_third("in transit")) + q, smol.encode(status_third("delivered")) + q
    assert len(p1) > 600
    _, first, _ = ask(router, p1, policy)
    assert first.plan.steps == () and b.calls["prefill"] == 0          # cold: the decode engine computed it
    assert metric(router.metrics.render().decode(), "kvnotes_prompt_stores_total", outcome="stored") == 1
    toks, fin, _ = ask(router, p2, policy)
    notes = fin.plan.notes
    assert any("first divergence from a held prompt" in n for n in notes), notes    # the edit was found...
    assert any("edit-in-place not planned" in n for n in notes), notes             # ...and declined
    assert fin.plan.steps == () and b.calls["prefill"] == 0, (fin.plan.steps, notes)   # and no prefill ran
    assert any("the held prompt's edit reuses nothing of it: planned by the plain rules" in n for n in notes), notes
    text = router.metrics.render().decode()
    assert metric(text, "kvnotes_reuse_miss_total", reason="edit_declined") > 0.9 * len(p2)
    ref, _, _ = ask(router, p2, "exact", tenant="other")                 # a recompute's answer
    assert toks == ref


def test_the_state_store_writes_after_a_request_run_off_the_event_loop(smol, cold):
    router, _, state = cold
    q = smol.encode("What is the shipment status now?")
    _, fin, loop_thread = ask(router, smol.encode(status_third("in transit")) + q, "exact")
    names = {n for n, _ in state.writes}
    assert {"put_decode_held", "put_prompt_blocks", "put_held_prompt"} <= names, names
    on_loop = [n for n, t in state.writes if t is loop_thread]
    assert not on_loop, f"state-store writes on the event loop's thread: {on_loop}"
    # the store behind it went through the gate that lets requests go first (tests/test_background_yield.py)
    assert isinstance(router.streams.store_behind.backends, YieldingBackends)
    assert router.streams.activity.started == 1 and router.streams.activity.active == 0
