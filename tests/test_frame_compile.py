"""Chunks compiled in their frame (exact reuse of the first chunk), question-guided recompute,
and the yes/no decision cases of the answer-based fidelity target."""
import dataclasses
import re

import pytest
import torch

from kvruntime.fidelity.cases import load_decision_cases
from kvruntime.fidelity.metrics import kl_divergence
from kvruntime.messages.keys import ChunkKey, prefix_hash
from kvruntime.ops import ChunkSegment, TextSegment, compose, precompile_chunk, recompute
from kvruntime.ops.frame import chat_frame, compile_prefix, newline_prefix
from kvruntime.ops.probes import question_layers
from kvruntime.ops.qselect import question_recompute, question_scores

SKILL = ("Refund rule: orders under 50 euros are refunded at once; larger orders need a receipt "
         "and take five working days.\n\n")
MEMO = "The customer, Ada Brandt, ordered a 72 euro kettle on 3 May.\n\n"
Q = "How long will Ada's refund take?"


def _frame_with(engine, system: str) -> list[int]:
    spec = engine.spec
    if not spec.chat_user_prefix:                          # base model: BOS + a plain-text header
        return chat_frame(engine) + engine.encode(system + "\n\n")
    prefix = re.sub(r"(<\|im_start\|>system\n).*?(<\|im_end\|>)", lambda m: m.group(1) + system + m.group(2),
                    spec.chat_user_prefix, flags=re.S)
    return engine.encode(prefix)


@pytest.mark.slow
def test_same_skill_after_two_system_prompts_is_two_variants_each_exact(engine):
    skill, memo = engine.encode(SKILL), engine.encode(MEMO)
    q = engine.encode(Q + engine.spec.chat_user_suffix)
    frames = [_frame_with(engine, "You answer refund questions."), _frame_with(engine, "You are a terse clerk.")]
    assert frames[0] != frames[1]
    kvs = [precompile_chunk(engine, skill, f) for f in frames]
    assert kvs[0].positions.tolist() == list(range(len(frames[0]), len(frames[0]) + len(skill)))
    assert not torch.allclose(kvs[0].data, kvs[1].data, atol=1e-3)      # the frame changes the chunk's KV
    keys = {ChunkKey.build(engine.spec.name, "float32", "ab", skill, "cd", len(f), prefix=prefix_hash(f)) for f in frames}
    assert len(keys) == 2                                  # two content addresses, one per frame
    for f, kv in zip(frames, kvs):
        res = compose(engine, [TextSegment(f), ChunkSegment(kv, tuple(f)), ChunkSegment(
            precompile_chunk(engine, memo, f), tuple(f)), TextSegment(q)], seam_tokens=1)
        first = recompute(engine, f + skill)               # one forward, exactly what compiled the chunk
        n0, n1 = len(f), len(f) + len(skill)
        assert torch.equal(res.kv.data[:, :, :, n0:n1], first.kv.data[:, :, :, n0:n1])
        assert torch.allclose(res.kv.data[:, :, :, :n0], first.kv.data[:, :, :, :n0], atol=1e-4)
        # the first chunk is reused whole; only the second chunk's seam, the frame and q are computed
        assert res.reused_tokens == len(skill) + len(memo) - 1
        assert res.computed_tokens == len(f) + 1 + len(q)
        assert res.chunk_starts == [n0, n1]
    # compiled after the other frame, the skill is not exact there: repositioned + seam repaired
    other = compose(engine, [TextSegment(frames[1]), ChunkSegment(kvs[0], tuple(frames[0])), TextSegment(q)],
                    seam_tokens=1)
    assert other.computed_tokens == len(frames[1]) + 1 + len(q)


@pytest.mark.slow
def test_exact_first_chunk_takes_no_recompute_budget_and_matches_recompute(smol):
    f = chat_frame(smol)
    skill = smol.encode(SKILL)
    q = smol.encode(Q + smol.spec.chat_user_suffix)
    res = compose(smol, [TextSegment(f), ChunkSegment(precompile_chunk(smol, skill, f), tuple(f)), TextSegment(q)],
                  seam_tokens=1, recompute_ratio=0.5)
    full = recompute(smol, f + skill + q)
    assert res.computed_tokens == len(f) + len(q) and res.probed_tokens == 0
    assert kl_divergence(full.logits, res.logits) < 1e-6


def test_the_router_and_the_engine_see_one_chat_frame(engine):
    """The router's renderer (tokenizer only) and the engine's compile prefix come from the one
    definition, ModelSpec.chat_frame: BOS where the model uses one, then the user-turn opener."""
    from cluster.control.render import Renderer
    r = Renderer(engine.tokenizer, engine.spec, None, engine.bos_id)
    f = chat_frame(engine)
    assert list(r.frame()) == f == engine.spec.chat_frame(engine.bos_id, engine.encode)
    bos = [engine.bos_id] if engine.spec.prepend_bos else []
    assert f[:len(bos)] == bos and len(f) == len(bos) + len(engine.encode(engine.spec.chat_user_prefix))


def test_compile_modes_and_bad_input(smol):
    assert compile_prefix(smol, "bos") is None
    assert compile_prefix(smol, "frame") == chat_frame(smol) == smol.encode(smol.spec.chat_user_prefix)
    assert compile_prefix(smol, "nl4") == [smol.bos_id] + smol.encode("\n\n\n\n")
    for bad in ("frames", "nl", "nlx", "nl0"):
        with pytest.raises(ValueError):
            compile_prefix(smol, bad)
    with pytest.raises(ValueError):
        newline_prefix(smol, 0)
    with pytest.raises(ValueError, match="empty chunk"):
        precompile_chunk(smol, [], chat_frame(smol))


def test_question_probe_names():
    assert question_layers("qlast", 30) == ((29,), 0)
    assert question_layers("qlate", 30) == (tuple(range(23, 30)), 0)
    assert question_layers("q1-g2", 30) == ((1,), 2)
    for bad in ("q", "qlast-g", "qfirst", "q30", "qlast-g9"):
        with pytest.raises(ValueError):
            question_layers(bad, 30)


@pytest.mark.slow
def test_question_scores_equal_the_models_own_attention_probabilities():
    """Against an independent engine running eager attention with output_attentions."""
    from kvruntime.engine import ReferenceEngine
    eng = ReferenceEngine("smollm2-135m", threads=1)
    ctx = chat_frame(eng) + eng.encode(SKILL + MEMO)
    q = eng.encode(Q + eng.spec.chat_user_suffix)
    kv = recompute(eng, ctx).kv
    last, late = question_layers("qlast", eng.num_layers)[0], question_layers("qlate", eng.num_layers)[0]
    got_last, got_late = question_scores(eng, kv, q, last), question_scores(eng, kv, q, late)
    eng.model.set_attn_implementation("eager")
    ids = torch.tensor([ctx + q])
    with torch.inference_mode():
        att = eng.model(input_ids=ids, output_attentions=True).attentions
    want = [a[0, :, len(ctx):, :len(ctx)].float().mean(dim=(0, 1)) for a in att]
    assert torch.allclose(got_last, want[last[0]], atol=1e-5)
    assert torch.allclose(got_late, torch.stack([want[i] for i in late]).mean(0), atol=1e-5)
    assert float(got_last.sum()) <= 1.0 + 1e-5


@pytest.mark.slow
def test_question_recompute_ratio_one_is_recompute_and_needs_a_question(smol):
    f = chat_frame(smol)
    a, b = smol.encode(SKILL), smol.encode(MEMO)
    q = smol.encode(Q + smol.spec.chat_user_suffix)
    segs = [TextSegment(f), ChunkSegment(precompile_chunk(smol, a)), ChunkSegment(precompile_chunk(smol, b)),
            TextSegment(q)]
    full = recompute(smol, f + a + b + q)
    all_ = compose(smol, segs, seam_tokens=1, recompute_ratio=1.0, probe="qlast")
    assert kl_divergence(full.logits, all_.logits) < 1e-6
    part = compose(smol, segs, seam_tokens=1, recompute_ratio=0.25, probe="qlate-g1")
    assert part.probed_tokens == len(q)                  # one scoring pass of the question
    assert part.computed_tokens == len(f) + 2 + len(q) + -(-(len(a) + len(b) - 2) // 4)
    with pytest.raises(ValueError, match="needs text after the chunks"):
        compose(smol, segs[:-1], recompute_ratio=0.25, probe="qlast")
    # the picked slots are the chunk slots the question attends to most
    kv = compose(smol, segs[:-1], seam_tokens=0).kv
    res = question_recompute(smol, kv, len(f), 0.1, q, probe="qlast")
    s = question_scores(smol, kv, q, question_layers("qlast", smol.num_layers)[0])[len(f):]
    assert res.recomputed_slots == sorted((torch.topk(s, len(res.recomputed_slots)).indices + len(f)).tolist())


def test_decision_cases_are_deterministic_balanced_and_answerable_from_the_memory():
    cases, passages = load_decision_cases(40)
    again, _ = load_decision_cases(40)
    assert cases == again and len({c.id for c in cases}) == 40
    assert sum(c.answers == ("yes",) for c in cases) == 20
    for c in cases:
        assert c.kind == "decision" and c.prelude and len(c.chunks) == 1
        names = re.search(r"only if both (.+?) and (.+?) are enabled", c.question).groups()
        state = dict(re.findall(r"^- (.+?): (enabled|disabled)", passages[c.chunks[0]], re.M))
        want = "yes" if all(state[n] == "enabled" for n in names) else "no"
        assert c.answers == (want,), c.id
    with pytest.raises(ValueError):
        load_decision_cases(0)
    assert dataclasses.replace(cases[0]).prelude == cases[0].prelude


def test_methods_grid_names_and_paired_bound():
    from kvruntime.fidelity.methods import method_ops, newcombe_paired_upper
    ops = method_ops(["bos", "frame"], ["seam4", "kv1", "qlate-g1"], [0.05, 0.1])
    assert ops["frame | seam 4"] == dict(compile="frame", rotate=True, seam_tokens=4)
    assert ops["bos | qlate-g1 10%"]["probe"] == "qlate-g1" and ops["bos | qlate-g1 10%"]["recompute_ratio"] == 0.1
    assert len(ops) == 2 * (1 + 2 * 2)
    # no discordant pairs: no drop; a lost answer widens the bound, more cases narrow it
    assert newcombe_paired_upper(10, 0, 0, 10) < 0.01
    assert newcombe_paired_upper(17, 1, 0, 17) > newcombe_paired_upper(45, 1, 0, 44) > 0.02
    assert newcombe_paired_upper(10, 0, 3, 7) < 0                 # the op gained answers
