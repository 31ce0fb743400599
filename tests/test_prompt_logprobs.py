"""The prompt's own log-probs (completions ``echo`` + ``logprobs``): the plan a full recompute
(``cluster.control.prompt_logprobs``), the prefill worker's build keeping each row
(``prefill_workers.steps``) and equal to a direct forward of the model (transformers' own
attention, not the engine's), the response's vLLM shape (``cluster.http.logprobs``)."""
import functools
from types import SimpleNamespace

import pytest
import torch

from cluster.control.planner import RenderedRequest, RenderedSegment
from cluster.control.prompt_logprobs import scored_plan
from cluster.http.logprobs import Logprobs
from kvruntime.messages.decode import SamplingParams, TokenEvent, TokenLogprob
from kvruntime.messages.plan import KVRef, PlanKind, Policy, RequestPlan, SegmentPlan
from prefill_workers import steps
from prefill_workers.executor import PrefillExecutor
from tests.conftest import DictSource

TEXT = "The capital of France is Paris. The capital of Italy is Rome, and the capital of Spain is"


@functools.lru_cache(maxsize=1)
def _hf_model():
    import transformers
    from kvruntime.checkpoint import ensure_checkpoint
    from kvruntime.models import get_model_spec
    path = ensure_checkpoint(get_model_spec("smollm2-135m"))
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def direct_logprobs(ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: log p(. | ids[:i+1]) by one plain transformers forward (the oracle)."""
    with torch.inference_mode():
        logits = _hf_model()(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def _request(ids):
    return RenderedRequest("r1", "smollm2-135m", Policy.FAST, (RenderedSegment("prompt", None, tuple(ids[:-1])),),
                           (ids[-1],))


class _Counter:
    def __init__(self):
        self.n = {}

    def labels(self, reason):
        return SimpleNamespace(inc=lambda v: self.n.__setitem__(reason, self.n.get(reason, 0) + v))


def test_the_plan_is_a_full_recompute_and_counted():
    m = SimpleNamespace(reuse_misses=_Counter())
    plan = scored_plan(_request(list(range(1, 11))), 3, m)
    assert plan.prompt_logprobs == 3 and plan.kind is PlanKind.RECOMPUTE and plan.reused_tokens == 0
    assert [(s.kind, s.position, s.tokens) for s in plan.steps] == [(PlanKind.RECOMPUTE, 0, 9)]
    assert plan.explain()["prompt_logprobs"] == 3 and m.reuse_misses.n == {"prompt_logprobs": 9}
    one = scored_plan(RenderedRequest("r2", "smollm2-135m", Policy.FAST, (), (5,)), 3, m)
    assert one.steps == () and one.prompt_logprobs is None           # one token: nothing to score
    reuse = SegmentPlan(kind=PlanKind.REUSE, source="prompt", token_ids=(1, 2), position=0, computed=0, reused=2,
                        kv=KVRef((1, 2), 0, "s"))
    with pytest.raises(ValueError, match="recompute only"):
        RequestPlan("r3", "smollm2-135m", Policy.FAST, (reuse,), (3,), prompt_logprobs=1)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


@pytest.mark.parametrize("rows", [256, 7])          # one forward; forwards of 7 rows (the chunked path)
def test_the_build_returns_the_models_own_prompt_logprobs(smol, monkeypatch, rows):
    monkeypatch.setattr(steps, "SCORED_ROWS", rows)
    ids = smol.encode(TEXT)
    plan = scored_plan(_request(ids), 4, SimpleNamespace(reuse_misses=_Counter()))
    kv, st = PrefillExecutor(smol, DictSource(smol), None).build(plan)
    want = direct_logprobs(ids)
    got = st.prompt_logprobs
    assert [g.token_id for g in got] == ids[1:] and st.computed == len(ids) - 1
    for i, g in enumerate(got):
        assert g.logprob == pytest.approx(float(want[i, ids[i + 1]]), abs=2e-3)
        top = want[i].topk(4)
        assert [t for t, _ in g.top_logprobs] == top.indices.tolist()
        assert [v for _, v in g.top_logprobs] == pytest.approx(top.values.tolist(), abs=2e-3)
    # the KV built is the prompt's: what a plain recompute plan builds
    plain = RequestPlan("r4", plan.model, plan.policy, plan.steps, plan.suffix_ids)
    ref, st2 = PrefillExecutor(smol, DictSource(smol), None).build(plain)
    assert st2.prompt_logprobs == [] and torch.allclose(kv.data, ref.data, atol=1e-4)


class _Tok:
    def decode(self, ids):
        return "".join(chr(96 + i) * i for i in ids)     # 1 -> "a", 2 -> "bb", 3 -> "ccc"


def test_the_completions_shape_is_vllms():
    lp = Logprobs(_Tok(), chat=False)
    scored = (TokenLogprob(2, -1.5, ((1, -0.5), (2, -1.5))), TokenLogprob(1, -0.25, ((1, -0.25),)))
    ev = TokenEvent(3, "ccc", 0, logprob=-float("inf"), top_logprobs=((1, -0.1),))
    out = lp.of([ev], prompt=((1, 2, 1), scored))
    assert out["tokens"] == ["a", "bb", "a", "ccc"]
    assert out["token_logprobs"] == [None, -1.5, -0.25, -9999.0]        # the first has none; -inf floored
    assert out["top_logprobs"] == [None, {"bb": -1.5, "a": -0.5}, {"a": -0.25}, {"ccc": -9999.0, "a": -0.1}]
    assert out["text_offset"] == [0, 1, 3, 4]
    assert lp.of([ev], offset=10)["text_offset"] == [10]                # a streamed chunk's
    assert lp.of([TokenEvent(1, "a", 0)]) is None
    with pytest.raises(RuntimeError, match="1 of its 2"):
        lp.of([], prompt=((1, 2, 1), scored[:1]))
