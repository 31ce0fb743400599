"""``ReferenceEngine.prefill`` / ``continue_greedy`` into the buffer that holds the prefix (issue 47
item 3): with a :class:`~kvruntime.kv.KVBuffer` that has room, the forward writes the new tokens'
K/V into the prefix's own buffer and attends to it there -- never a second copy of the prefix
(``engine.copied_bytes`` unchanged; every forward's ``data`` is that buffer's storage) -- and the
result is bit-equal to the copying path (``past`` a plain KVCache, copied once, counted). The same
for the three callers: question-guided selection (``ops.qselect``, compose), the shadow check
(``PrefillExecutor.shadow``) and a chunk's precompile. Tiny random-weight checkpoints of five
families (tests/tiny_checkpoints.py: GQA, q/k norm, soft-capping, sliding layers, fused qkv) and
the shipped SmolLM2, fp32 CPU."""
from __future__ import annotations

import pytest
import torch

from kvruntime.kv import KVBuffer, KVCache
from tests.conftest import get_engine, tiny_engine

FAMILIES = ["llama3", "qwen3", "gemma2", "gemma3", "phi3"]
NAMES = FAMILIES + ["smollm2-135m"]


def _engine(request, name):
    if name == "smollm2-135m":
        return get_engine(name)
    return tiny_engine(request.getfixturevalue("tiny_checkpoints"), name)


def _ids(e, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, min(500, e.model.config.vocab_size), (n,), generator=g).tolist()


class _Writes:
    """Records the storage (``data_ptr``) and capacity of the buffer every forward writes into."""

    def __init__(self, monkeypatch, e):
        self.calls: list[tuple[int, int]] = []
        real = e.write

        def write(data, *a, **kw):
            self.calls.append((data.data_ptr(), data.shape[3]))
            return real(data, *a, **kw)
        monkeypatch.setattr(e, "write", write)

    def since(self, mark: int) -> list[tuple[int, int]]:
        return self.calls[mark:]


def _prefix_buffer(e, ids, room: int) -> KVBuffer:
    """The prefix computed into a buffer with ``room`` more slots (as the builder / receive does)."""
    from kvruntime.ops.build import Builder
    b = Builder(e, len(ids) + room)
    b.compute(ids, 0)
    return b.buf


@pytest.mark.parametrize("name", NAMES)
def test_prefill_into_the_prefix_buffer_is_in_place_and_bit_equal_to_the_copying_path(request, monkeypatch, name):
    e = _engine(request, name)
    prefix, sfx = _ids(e, 80, 1), _ids(e, 4, 2)
    buf = _prefix_buffer(e, prefix, 4 + 8)
    plain = KVCache(buf.view().data.clone(), buf.view().positions.clone(), buf.view().token_ids.clone())
    before = buf.view().data.clone()
    pos = torch.arange(80, 84)
    c0 = e.copied_bytes
    copied = e.prefill(sfx, pos, plain, logits=True)                     # the copying path
    assert e.copied_bytes - c0 == plain.nbytes                          # its one copy, counted
    writes = _Writes(monkeypatch, e)
    c1 = e.copied_bytes
    got = e.prefill(sfx, pos, buf, logits=True)
    assert e.copied_bytes == c1                                         # nothing copied
    assert writes.calls == [(buf.data.data_ptr(), buf.capacity)]        # the suffix ran in the prefix's buffer
    assert got.kv.data.data_ptr() == buf.data[:, :, :, 80:].data_ptr() and buf.length == 84
    assert torch.equal(got.logits, copied.logits) and torch.equal(got.kv.data, copied.kv.data)
    assert torch.equal(buf.view().data[:, :, :, :80], before)           # the prefix slots as they were
    assert buf.view().positions.tolist() == list(range(84)) and buf.view().token_ids.tolist() == prefix + sfx
    with pytest.raises(ValueError, match="room"):
        e.prefill(_ids(e, 9, 3), torch.arange(84, 93), buf)             # 8 slots left


@pytest.mark.parametrize("name", NAMES)
def test_continue_greedy_runs_suffix_and_decode_in_the_buffer_bit_equal_to_copying(request, monkeypatch, name):
    """The shadow check's continuation: the suffix and every greedy step in the prefix's buffer."""
    e = _engine(request, name)
    prefix, sfx, n = _ids(e, 64, 4), _ids(e, 3, 5), 6
    buf = _prefix_buffer(e, prefix, len(sfx) + n)
    plain = KVCache(buf.view().data.clone(), buf.view().positions.clone(), buf.view().token_ids.clone())
    c0 = e.copied_bytes
    want_logits, want = e.continue_greedy(plain, sfx, n, stop_at_eos=False)
    assert e.copied_bytes - c0 == plain.nbytes                          # copied once (not three times)
    writes = _Writes(monkeypatch, e)
    c1 = e.copied_bytes
    logits, got = e.continue_greedy(buf, sfx, n, stop_at_eos=False)
    assert e.copied_bytes == c1
    assert {w for w in writes.calls} == {(buf.data.data_ptr(), buf.capacity)} and len(writes.calls) == n
    assert torch.equal(logits, want_logits) and got == want and len(got) == n
    # the old shadow path: prefill (a copy), cat (a second), greedy's session (a third): the same tokens
    old = e.prefill(sfx, torch.arange(64, 67), plain, logits=True)
    assert torch.equal(old.logits, logits)
    assert e.greedy(KVCache.cat([plain, old.kv]), old.logits, n) == got


@pytest.mark.parametrize("name", ["llama3", "gemma3", "phi3", "smollm2-135m"])
def test_question_scores_run_in_the_builders_room_bit_equal_to_the_copying_path(request, monkeypatch, name):
    from kvruntime.ops.qselect import question_scores
    e = _engine(request, name)
    prefix, q = _ids(e, 70, 6), _ids(e, 5, 7)
    buf = _prefix_buffer(e, prefix, len(q))
    kv = buf.view()
    layers = [e.num_layers - 1, e.num_layers - 2]
    c0 = e.copied_bytes
    want = question_scores(e, kv, q, layers)                            # no room: kv copied once, counted
    assert e.copied_bytes - c0 == kv.nbytes
    writes = _Writes(monkeypatch, e)
    c1 = e.copied_bytes
    got = question_scores(e, kv, q, layers, room=buf)
    assert e.copied_bytes == c1 and writes.calls == [(buf.data.data_ptr(), buf.capacity)]
    assert torch.equal(got, want) and buf.length == 70                  # scored, not committed


@pytest.mark.parametrize("name", ["llama3", "smollm2-135m"])
def test_compose_with_a_question_probe_and_precompile_copy_no_context(request, monkeypatch, name):
    """compose's paths through the engine: a chunk's precompile (its KV is the buffer its forward
    wrote) and compose with a question probe (every forward in the one buffer) copy nothing."""
    from kvruntime.ops import ChunkSegment, TextSegment, compose, precompile_chunk
    from kvruntime.ops.compose import default_prefix
    e = _engine(request, name)
    writes = _Writes(monkeypatch, e)
    c0 = e.copied_bytes
    ca = precompile_chunk(e, _ids(e, 40, 8))
    anchor = len(default_prefix(e)) * e.head_dim * ca.data.element_size()      # the anchor's slots, dropped
    assert writes.calls[-1][0] == ca.data.data_ptr() - anchor
    cb = precompile_chunk(e, _ids(e, 30, 9))
    mark = len(writes.calls)
    res = compose(e, [TextSegment(_ids(e, 10, 10)), ChunkSegment(ca), ChunkSegment(cb), TextSegment(_ids(e, 6, 11))],
                  seam_tokens=1, recompute_ratio=0.3, probe="qlast")
    assert e.copied_bytes == c0
    assert {p for p, _ in writes.since(mark)} == {res.kv.data.data_ptr()} and len(writes.since(mark)) >= 4


@pytest.fixture(scope="module")
def shadowed(smol):
    from kvruntime.messages.plan import KVRef
    from prefill_workers.executor import PrefillExecutor
    from tests.conftest import DictSource
    src = DictSource(smol)
    frame = tuple(smol.encode(smol.spec.chat_user_prefix))
    ids = tuple(smol.encode("The Varga Museum opens at 10:00 and closes at 17:30; entry costs 12 euros.\n\n"))
    q = tuple(smol.encode("When does the Varga Museum close?" + smol.spec.chat_user_suffix))
    return smol, src, PrefillExecutor(smol, src, None), frame, (ids, KVRef(ids, 1, "5a" * 16)), q


def _plans(e, src, frame, skill, q):
    from cluster.control.planner import (ComposeChoice, PlannerConfig, RenderedRequest, RenderedSegment, TierView,
                                         compose_op_key, plan_request)
    from kvruntime.messages.plan import Policy
    from kvruntime.ops import precompile_chunk
    ids, ref = skill
    src.put(ref, precompile_chunk(e, list(ids)))
    segs = (RenderedSegment("text", None, frame), RenderedSegment("skill", "museum", ids, kv=ref))
    cfg = PlannerConfig(balanced=ComposeChoice(True, 1, 0.3, compose_op_key(1, 0.3, "qlast"), "test", probe="qlast"))
    tier = TierView(frozenset({ref.digest}))
    return {"fast": plan_request(RenderedRequest("rf", e.spec.name, Policy.FAST, segs, q), tier, None, e.encode),
            "qlast": plan_request(RenderedRequest("rq", e.spec.name, Policy.BALANCED, segs, q), tier, None, e.encode,
                                  cfg)}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fast", "qlast"])
def test_shadow_runs_the_suffix_and_greedy_in_the_builds_buffer_bit_equal_to_copying(shadowed, monkeypatch, kind):
    e, src, pre, frame, skill, q = shadowed
    plan = _plans(e, src, frame, skill, q)[kind]
    assert kind == "fast" or any(s.probe == "qlast" and s.recompute_ratio == 0.3 for s in plan.steps)
    n = 16
    kv, _ = pre.build(plan)                                             # the old shadow: built at the prefix's size,
    old = e.prefill(list(q), torch.arange(kv.num_tokens, kv.num_tokens + len(q)), kv, logits=True)   # copied,
    old_got = e.greedy(KVCache.cat([kv, old.kv]), old.logits, n, stop_at_eos=True)               # cat, copied
    writes = _Writes(monkeypatch, e)
    c0 = e.copied_bytes
    build = pre._plan_build(plan, room=len(q) + n)
    built, st = build.build()
    assert not st.fallbacks                                             # the question probe ran as planned
    buf = build.run.builder.buf
    assert buf is not None and built.data.data_ptr() == buf.data.data_ptr() and buf.capacity == kv.num_tokens + len(q) + n
    mark = len(writes.calls)
    logits, got = e.continue_greedy(buf, q, n)
    assert e.copied_bytes == c0                                         # the prefix never copied
    assert {p for p, _ in writes.since(mark)} == {buf.data.data_ptr()}
    assert torch.equal(built.data, kv.data) and torch.equal(logits, old.logits) and got == old_got
    # shadow itself: the suffix forward after the build lands in the build's buffer (slot == prefix)
    mark, c1 = len(writes.calls), e.copied_bytes
    r = pre.shadow(plan, greedy_n=n)
    caps = [c for _, c in writes.since(mark)]
    assert kv.num_tokens + len(q) + n in caps and r.top1 in (0.0, 1.0)
    # the one copy left is the oracle's: its recomputed KV (prefix + suffix) into its greedy session
    assert e.copied_bytes - c1 == (kv.num_tokens + len(q)) * kv.nbytes // kv.num_tokens
    build_ptrs = {p for p, c in writes.since(mark) if c == kv.num_tokens + len(q) + n}
    assert len(build_ptrs) == 1                                         # build, suffix and greedy: one buffer


def test_a_buffer_holding_received_kv_adopts_its_memory_and_refuses_any_other():
    data = torch.randn(2, 2, 1, 10, 4)
    kv = KVCache(data[:, :, :, :6], torch.arange(6), torch.arange(6) + 3)
    buf = KVBuffer.holding(data, kv)
    assert buf.length == 6 and buf.capacity == 10 and buf.view().data.data_ptr() == data.data_ptr()
    assert buf.view().token_ids.tolist() == list(range(3, 9)) and buf.view().positions.tolist() == list(range(6))
    with pytest.raises(ValueError, match="first slots"):
        KVBuffer.holding(data, KVCache(kv.data.clone(), kv.positions, kv.token_ids))     # a copy
    with pytest.raises(ValueError, match="first slots"):
        KVBuffer.holding(data, kv.slice(1))                                              # not from slot 0


@pytest.mark.parametrize("name", ["llama3", "gemma3"])
def test_bucketed_prefill_into_the_prefix_buffer_is_bit_equal_to_the_copying_path(request, monkeypatch, name):
    """Under ``few_token_shapes: bucketed`` (3 tokens padded to 4) the in-place path is the same."""
    from kvruntime.config.choices import ForwardShapes
    e = _engine(request, name)
    monkeypatch.setattr(e, "shapes", ForwardShapes.BUCKETED)
    prefix, sfx = _ids(e, 50, 12), _ids(e, 3, 13)
    buf = _prefix_buffer(e, prefix, 8)
    plain = KVCache(buf.view().data.clone(), buf.view().positions.clone(), buf.view().token_ids.clone())
    copied = e.prefill(sfx, torch.arange(50, 53), plain, logits=True)
    c = e.copied_bytes
    got = e.prefill(sfx, torch.arange(50, 53), buf, logits=True)
    assert e.copied_bytes == c and got.kv.data.data_ptr() == buf.data[:, :, :, 50:].data_ptr()
    assert torch.equal(got.logits, copied.logits) and torch.equal(got.kv.data, copied.kv.data)
