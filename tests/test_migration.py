"""Decode migration and prefill cancellation (a worker that dies mid-request).

- Decode side, real engine: a continuation (prompt + the tokens already streamed, from step k)
  yields exactly the events an undisturbed run yields from step k on: seeded sampling, penalties,
  stop strings spanning the boundary, log-probs, ``max_tokens`` and the summary's counts.
- Prefill side, real engine: a plan cancelled while it runs stops between layers (the number of
  layers it ran is counted, not timed).
- Real cluster: tests/test_faults.py (its cluster, started once for both: a decode actor SIGKILLed
  by PID under 32 concurrent greedy streams, every stream completes unchanged; a prefill past its
  request's deadline is stopped by its worker).
"""
from __future__ import annotations

import dataclasses

import pytest

from kvruntime.messages.decode import Continuation, DecodeSummary, SamplingParams, TokenEvent

PROMPT = "The lighthouse keeper wrote in his log every night. On the first night of winter he wrote:"


def _run(ex, prompt_ids, sampling, cont=None):
    evs = list(ex.generate(None, tuple(prompt_ids[:-4]), tuple(prompt_ids[-4:]), sampling, continuation=cont))
    return [e for e in evs if isinstance(e, TokenEvent)], evs[-1]


@pytest.fixture(scope="module")
def executor(smol, one_torch_thread):
    from decode_workers.executor import DecodeExecutor
    from kvtransport.transfer.grpc_transport import GrpcTransport
    return DecodeExecutor(smol, GrpcTransport(), receive_timeout=1)


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_tokens=14, temperature=0.9, top_p=0.95, seed=1234, presence_penalty=0.8,
                   frequency_penalty=0.6, logprobs=2),
    SamplingParams(max_tokens=14, temperature=0.0, frequency_penalty=1.5, logprobs=1),
], ids=["seeded_penalties", "greedy_penalty"])
def test_a_continuation_yields_what_an_undisturbed_run_yields(smol, executor, sampling):
    ids = smol.tokenizer.encode(PROMPT)
    full, summ = _run(executor, ids, sampling)
    assert len(full) == 14 and summ.completion_tokens == 14
    for k in (1, 5, 13):
        cont = Continuation(tuple(e.token_id for e in full[:k]), "".join(e.text for e in full[:k]))
        rest, s = _run(executor, ids, sampling, cont)
        assert [(e.token_id, e.text, e.index) for e in rest] == [(e.token_id, e.text, e.index) for e in full[k:]], k
        assert [e.top_logprobs[0][0] for e in rest] == [e.top_logprobs[0][0] for e in full[k:]]
        assert all(abs(a.logprob - b.logprob) < 1e-3 for a, b in zip(rest, full[k:]))
        assert (s.completion_tokens, s.finish_reason, s.text) == (summ.completion_tokens, summ.finish_reason,
                                                                 summ.text)
    # a different seed draws differently: the equality above is the continuation's, not the prompt's
    other, _ = _run(executor, ids, dataclasses.replace(sampling, seed=99))
    assert sampling.temperature == 0 or [e.token_id for e in other] != [e.token_id for e in full]


def test_a_stop_string_spanning_the_boundary_still_stops(smol, executor):
    ids = smol.tokenizer.encode(PROMPT)
    free, _ = _run(executor, ids, SamplingParams(max_tokens=16))
    text = "".join(e.text for e in free)
    at = len(text) // 2
    stop = text[at:at + 10]                                      # 10 characters in the middle of the output
    at = text.find(stop)
    sp = SamplingParams(max_tokens=16, stop=(stop,))
    full, summ = _run(executor, ids, sp)
    assert summ.finish_reason == "stop" and summ.text == text[:at] and len(full) < 16
    # cut before the token that completes the stop string, after the one that starts it: the
    # lost worker held part of it back
    k = len(full) - 1
    assert len(smol.decode([e.token_id for e in full[:k]])) > at
    cont = Continuation(tuple(e.token_id for e in full[:k]), "".join(e.text for e in full[:k]))
    rest, s = _run(executor, ids, sp, cont)
    assert [(e.token_id, e.text) for e in rest] == [(e.token_id, e.text) for e in full[k:]]
    assert (s.finish_reason, s.text, s.completion_tokens) == ("stop", summ.text, summ.completion_tokens)
    # the lost worker had streamed every token: only the summary is left to say
    cont = Continuation(tuple(e.token_id for e in full), "".join(e.text for e in full))
    rest, s = _run(executor, ids, sp, cont)
    assert rest == [] and isinstance(s, DecodeSummary) and (s.finish_reason, s.text) == ("stop", summ.text)


def test_a_prefill_cancelled_while_it_runs_stops_between_layers(smol, one_torch_thread):
    """The cancel flag goes up after the 3rd layer of the plan's forward: the build stops there
    (the layers run are counted by a hook), nothing is sent."""
    from kvruntime.engine import Cancelled
    from kvruntime.messages.plan import PlanKind, Policy, RequestPlan, SegmentPlan
    from prefill_workers.executor import PrefillExecutor
    from tests.conftest import DictSource

    from kvtransport.transfer.interface import KVSender

    class NoSend(KVSender):
        def send(self, *a, **kw):
            raise AssertionError("a cancelled plan sends nothing")
    ids = tuple(smol.tokenizer.encode(PROMPT * 4))
    plan = RequestPlan("r1", smol.spec.name, Policy.EXACT,
                       (SegmentPlan(kind=PlanKind.RECOMPUTE, source="prompt", token_ids=ids, position=0,
                                    computed=len(ids), reused=0),), (ids[-1],))
    ran = []
    hooks = [layer.register_forward_hook(lambda *_: ran.append(1)) for layer in smol.model.model.layers]
    try:
        ex = PrefillExecutor(smol, DictSource(smol), NoSend())
        with pytest.raises(Cancelled):
            ex.execute(plan, "127.0.0.1:1", "t1", cancelled=lambda: len(ran) >= 3)
        assert len(ran) == 3 < smol.num_layers
        ran.clear()
        kv, _ = ex.build(plan, cancelled=lambda: False)              # not cancelled: every layer runs
        assert len(ran) == smol.num_layers and kv.num_tokens == len(ids)
    finally:
        for h in hooks:
            h.remove()
