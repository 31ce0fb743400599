"""vLLM as the decode engine, through the kvnotes KV connector (real vLLM, real gRPC).

* KV composed by kvnotes (precompiled chunks repositioned + seam repair, and edit-in-place)
  and decoded by vLLM gives the reference engine's greedy tokens for the same KV.
* A missing or corrupt block follows the load failure policy: ``recompute`` (vLLM recomputes
  the prefix; the output equals a plain vLLM run; the fallback is reported) and ``fail`` (the
  request fails with a clear error), both counted.
* vLLM's own prefix cache still serves a repeated composed prefix, and a salt keeps composed KV
  away from exact requests.
* The asynchronous load (the default) gives the same tokens as the synchronous one, and a
  request waiting for its block does not stop the running requests.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="the vllm extra is not installed (scripts/dev.sh installs it)")

from kvruntime.messages.decode import DecodeSummary, SamplingParams, TokenEvent  # noqa: E402
from kvruntime.fidelity.cases import load_compose_cases, load_edit_cases, load_passages, split_template  # noqa: E402
from kvruntime.ops.frame import chat_frame  # noqa: E402
from kvruntime.kv import KVCache  # noqa: E402
from kvruntime.ops import edit_in_place, precompile_chunk, recompute  # noqa: E402
from kvruntime.ops.compose import ChunkSegment, TextSegment, compose  # noqa: E402
from kvtransport.transfer.blocks import KVBlock, encode_block  # noqa: E402
from kvtransport.transfer.grpc_transport import GrpcTransport  # noqa: E402
from kvtransport.transfer.interface import TransferError  # noqa: E402

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
GREEDY = 16
NEAR_TIE = 0.05       # nats: a divergence where the two candidates' log-probs differ by less is a tie


@pytest.fixture(scope="module")
def vx():
    from decode_workers import vllm_engine
    from decode_workers import vllm_adapter
    from decode_workers.vllm_settings import VllmEngineConfig
    x = vllm_engine.VllmDecodeExecutor(VllmEngineConfig(MODEL, dtype="float32", load_failure_policy="recompute",
                                                        receive_timeout_s=5.0, kv_cache_gib=1, max_model_len=4096))
    yield x
    x.stop()
    torch.set_num_threads = vllm_adapter._set_num_threads    # vLLM's CPU worker replaced it process-wide


@pytest.fixture(scope="module")
def sender():
    return GrpcTransport()


def _run(vx, tid, prefix, suffix, n=GREEDY, salt=None, kv_load=None):
    evs = list(vx.generate(tid, tuple(prefix), tuple(suffix), SamplingParams(max_tokens=n), salt=salt,
                           kv_load=kv_load))
    assert isinstance(evs[-1], DecodeSummary)
    return [e.token_id for e in evs if isinstance(e, TokenEvent)], evs[-1]


def _reference(engine, kv: KVCache, suffix: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens from the reference engine on ``kv`` + ``suffix`` and the logits of each step."""
    n = kv.num_tokens
    out = engine.prefill(suffix, torch.arange(n, n + len(suffix)), kv, logits=True)
    kv, logits = KVCache.cat([kv, out.kv]), out.logits
    toks, steps = [], []
    for _ in range(GREEDY):
        steps.append(logits)
        t = int(torch.argmax(logits))
        if t in engine.eos_ids:
            break
        toks.append(t)
        o = engine.prefill([t], torch.tensor([kv.num_tokens]), kv, logits=True)
        kv, logits = KVCache.cat([kv, o.kv]), o.logits
    return toks, steps


def _cases(engine):
    """(id, prefix KV built by a kvnotes operation, suffix ids): 8 compose + 4 edit-in-place."""
    pre, close = chat_frame(engine), engine.spec.chat_user_suffix
    passages = load_passages()
    for c in load_compose_cases()[:8]:
        chunks = [ChunkSegment(precompile_chunk(engine, engine.encode(passages[p].strip() + "\n\n")))
                  for p in c.chunks]
        yield c.id, compose(engine, [TextSegment(pre)] + chunks, seam_tokens=1).kv, engine.encode(c.question + close)
    for c in [c for c in load_edit_cases() if c.kind == "lookup"][:4]:
        head, _ = split_template(c)
        old_doc = engine.encode(c.template.format(**c.fields))
        new_doc = engine.encode(c.template.format(**{**c.fields, c.field: c.new}))
        ctx = recompute(engine, pre + old_doc, logits=False).kv
        a = len(pre) + len(engine.encode(head))
        old_len = len(engine.encode(head + c.old)) - len(engine.encode(head))
        new_len = len(engine.encode(head + c.new)) - len(engine.encode(head))
        if (pre + new_doc)[:a] != (pre + old_doc)[:a] or len(new_doc) - new_len != len(old_doc) - old_len:
            continue          # the field does not tokenize on its own; the planner would recompute
        res = edit_in_place(engine, ctx, (a, a + old_len), (pre + new_doc)[a:a + new_len], 16)
        assert res.kv.token_ids.tolist() == pre + new_doc
        yield c.id, res.kv, engine.encode(c.question + close)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_cache_update_writes_strided_views_like_contiguous_ones(dtype):
    """The connector hands vLLM's CPU backend transposed views of the block (no copy): the op
    must write exactly what it writes from contiguous copies, for keys (packed) and values."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, _get_attn_isa
    from decode_workers.vllm_adapter import takes_strided
    import vllm._custom_ops as ops
    layers, heads, tokens, dim, bs, blocks = 2, 3, 300, 64, 32, 16
    data = torch.randn(layers, 2, heads, tokens + 5, dim).to(dtype)
    slots = torch.randperm(blocks * bs)[:tokens]                # scattered slots, as vLLM's blocks are
    isa = _get_attn_isa(dtype, bs, dim)

    def write(strided):
        cache = torch.zeros(blocks, heads, bs, 2 * dim, dtype=dtype)
        kc, vc = cache.view(blocks, heads, 2 * bs, dim).chunk(2, dim=2)
        for i in range(layers):
            k, v = (data[i, j, :, 5:].transpose(0, 1) for j in (0, 1))
            if not strided:
                k, v = k.contiguous(), v.contiguous()
            ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
        return cache

    assert takes_strided(CPUAttentionBackendImpl.__new__(CPUAttentionBackendImpl))
    want = write(False)
    assert want.abs().sum() > 0
    assert torch.equal(write(True), want)


def test_scheduler_side_plans_one_load_per_block_and_reports_its_outcome():
    """The connector's scheduler half alone, with the request fields vLLM hands it: N prompt
    tokens minus the prefix-cache hit are external; the step's metadata maps them onto the
    allocated blocks' slots; the block is claimed once (a preempted request recomputes); a
    failure the worker half reports comes out in the finished request's params."""
    from types import SimpleNamespace

    from decode_workers.vllm_connector_meta import KvnotesWorkerMetadata
    from decode_workers.vllm_connector_scheduler import ConnectorScheduler
    from decode_workers.vllm_settings import ConnectorSettings, load_params

    sched = ConnectorScheduler(ConnectorSettings(MODEL, 5.0, "async", 1, inbox_key="k"), block_size=4)
    prompt = list(range(100, 111))                                          # 11 tokens, prefix N = 10
    req = SimpleNamespace(request_id="r1", kv_transfer_params=load_params("t1", 10), num_prompt_tokens=11,
                          prompt_token_ids=prompt)
    assert sched.get_num_new_matched_tokens(req, 4) == (6, True)           # 4 tokens hit the prefix cache
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([7, 3, 9],)), 6)
    (spec,) = sched.build_connector_meta().loads
    assert (spec.transfer_id, spec.start, spec.prefix_tokens, spec.async_load) == ("t1", 4, 10, True)
    assert spec.slot_mapping == (12, 13, 14, 15, 36, 37) and spec.block_ids == (3, 9)
    assert spec.token_ids == tuple(prompt[:10])
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)          # claimed once
    assert sched.build_connector_meta().loads == []
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=KvnotesWorkerMetadata(
        {"r1": "kv_transfer_timeout"}, {})))
    assert sched.request_finished(req) == (False, {"kvnotes_load": "failed:kv_transfer_timeout",
                                                   "kvnotes_loaded_tokens": 0, "kvnotes_stages": {}})
    with pytest.raises(ValueError, match="worker metadata"):
        sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=object()))
    plain = SimpleNamespace(request_id="r2", kv_transfer_params=None, num_prompt_tokens=5, prompt_token_ids=[1] * 5)
    assert sched.get_num_new_matched_tokens(plain, 0) == (0, False) and sched.request_finished(plain) == (False, None)


def test_worker_side_takes_the_registered_inbox_or_refuses_to_start(smol):
    """The worker half uses the inbox registered under its key (and leaves it running at its
    shutdown: the actor's to stop); a key nobody registered stops it, naming the key, instead of
    opening an inbox no sender knows."""
    from decode_workers.vllm_connector_worker import ConnectorWorker
    from decode_workers.vllm_inbox import INBOXES
    from decode_workers.vllm_settings import ConnectorSettings

    rx = GrpcTransport(model=MODEL)
    address = rx.serve("127.0.0.1", 0)
    key = INBOXES.register(rx)
    try:
        w = ConnectorWorker(ConnectorSettings(MODEL, 1.0, "async", 1, inbox_key=key))
        assert w.inbox is rx and w.address is None
        w.shutdown()
        kv = recompute(smol, smol.encode("Hello there"), logits=False).kv
        GrpcTransport().send(address, encode_block("still-open", MODEL, kv), timeout=30)   # not stopped
        assert rx.receive("still-open", timeout=5).header.transfer_id == "still-open"
    finally:
        INBOXES.release(key)
        rx.stop()
    with pytest.raises(LookupError, match="not-registered"):
        ConnectorWorker(ConnectorSettings(MODEL, 1.0, "async", 1, inbox_key="not-registered"))


def test_composed_kv_decoded_by_vllm_matches_reference(smol, vx, sender, one_torch_thread):
    report, exact = [], 0
    cases = list(_cases(smol))
    assert len(cases) >= 10, f"only {len(cases)} cases could be built"
    from concurrent.futures import ThreadPoolExecutor
    pool = ThreadPoolExecutor(1)
    try:
        for i, (cid, kv, suffix) in enumerate(cases):
            tid = f"fid-{i}"
            sender.send(vx.address, encode_block(tid, MODEL, kv), timeout=30)
            # vLLM decodes the case on its own step thread while the reference engine decodes it here
            # (one torch thread each: the two overlap on the machine's cores)
            run = pool.submit(_run, vx, tid, kv.token_ids.tolist(), suffix)
            ref, step_logits = _reference(smol, kv, suffix)
            got, summary = run.result(timeout=600)
            assert summary.fallbacks == (), (cid, summary)
            if got == ref:
                exact += 1
                report.append({"case": cid, "tokens": len(kv.token_ids), "match": True})
                continue
            j = next(k for k in range(min(len(got), len(ref)) + 1) if k >= len(got) or k >= len(ref) or got[k] != ref[k])
            lp = torch.log_softmax(step_logits[min(j, len(step_logits) - 1)].float(), -1)
            ref_tok = ref[j] if j < len(ref) else next(iter(smol.eos_ids))
            vllm_tok = got[j] if j < len(got) else next(iter(smol.eos_ids))
            gap = float(lp[ref_tok] - lp[vllm_tok])
            report.append({"case": cid, "match": False, "diverges_at": j, "logprob_gap": round(gap, 4)})
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    print("vLLM vs reference on kvnotes KV:", json.dumps(report, indent=1))
    ties = [r for r in report if not r["match"]]
    assert all(r["logprob_gap"] < NEAR_TIE for r in ties), f"a non-tie divergence: {ties}"
    assert exact >= len(cases) - 1, f"{exact}/{len(cases)} exact; near-ties: {ties}"


def _prompt(smol, n_words=300):
    pre, close = chat_frame(smol), smol.spec.chat_user_suffix
    doc = smol.encode(" ".join(f"Item {i} costs {i * 7 % 100} dollars." for i in range(n_words // 5)))
    return pre + doc, smol.encode("What does item 3 cost?" + close)


_PROMPT: dict = {}


def _prompt_kv(smol):
    """``(prefix, suffix, the reference engine's KV of prefix)`` of the one ~310-token prompt the
    load tests below share, computed once for the module (a recompute costs seconds). Sharing it
    changes nothing they check: each request carries a salt of its own, so vLLM's prefix cache
    never carries one test's blocks into another. Its length (150 words; they used 250-400) only
    has to span several vLLM blocks and end in a partial one: what they check (fallbacks, load
    parity, prefix-cache reuse by whole blocks) holds at any such length, and every vLLM prefill
    of it (four recompute fallbacks per load mode) costs half as much."""
    if not _PROMPT:
        prefix, suffix = _prompt(smol, 150)
        _PROMPT["v"] = prefix, suffix, recompute(smol, prefix, logits=False).kv
    return _PROMPT["v"]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_missing_and_corrupt_blocks_follow_recompute_policy(smol, vx, sender, one_torch_thread, mode):
    prefix, suffix, kv = _prompt_kv(smol)
    plain, _ = _run(vx, None, prefix, suffix, salt="plain-recompute")     # [sync]: an APC hit of [async]'s
    # never sent: the connector's receive times out, vLLM recomputes the prefix
    got, s = _run(vx, f"never-sent-{mode}", prefix, suffix, salt=f"missing-{mode}", kv_load=mode)
    assert got == plain and s.fallbacks == ("kv_transfer_timeout",) and s.loaded_tokens == 0
    # corrupt payload (header CRC kept): the receiver rejects it, vLLM recomputes
    good = encode_block(f"corrupt-{mode}", MODEL, kv)
    bad = bytearray(good.payload)
    bad[len(bad) // 2] ^= 0xFF
    with pytest.raises(TransferError):
        sender.send(vx.address, KVBlock(good.header, bytes(bad)), timeout=30)
    got, s = _run(vx, f"corrupt-{mode}", prefix, suffix, salt=f"corrupt-{mode}", kv_load=mode)
    assert got == plain and s.fallbacks == ("kv_transfer_rejected",)
    # a block of other tokens (a routing bug) is refused, not decoded
    # (the true KV of those tokens: the shared prefix's KV up to the last token, plus that other token's)
    last = smol.prefill([prefix[-1] + 1], torch.tensor([len(prefix) - 1]), kv.slice(0, len(prefix) - 1)).kv
    other = KVCache.cat([kv.slice(0, len(prefix) - 1), last])
    sender.send(vx.address, encode_block(f"other-{mode}", MODEL, other), timeout=30)
    got, s = _run(vx, f"other-{mode}", prefix, suffix, salt=f"other-{mode}", kv_load=mode)
    assert got == plain and s.fallbacks == ("kv_mismatch",)
    # and a good block after all that is used
    sender.send(vx.address, encode_block(f"good-{mode}", MODEL, kv), timeout=30)
    got, s = _run(vx, f"good-{mode}", prefix, suffix, salt=f"good-{mode}", kv_load=mode)
    assert s.fallbacks == () and got == plain and s.loaded_tokens == len(prefix)


def test_async_and_sync_loads_give_the_tokens_of_a_full_vllm_prefill(smol, vx, sender, one_torch_thread):
    prefix, suffix, kv = _prompt_kv(smol)
    plain, s0 = _run(vx, None, prefix, suffix, n=24, salt="parity-plain")
    assert s0.loaded_tokens == 0 and s0.cached_tokens == 0
    for mode in ("async", "sync"):
        sender.send(vx.address, encode_block(f"parity-{mode}", MODEL, kv), timeout=30)
        got, s = _run(vx, f"parity-{mode}", prefix, suffix, n=24, salt=f"parity-{mode}", kv_load=mode)
        assert got == plain and s.fallbacks == () and s.loaded_tokens == len(prefix), (mode, s)
        assert {"receive", "load"} <= dict(s.stages).keys()


def test_a_pending_async_load_does_not_stop_running_streams(smol, vx, sender, one_torch_thread):
    """Request B's block is pushed late on purpose: while B waits for it (vLLM's
    WAITING_FOR_REMOTE_KVS), the running stream A keeps producing tokens; then B loads and
    decodes exactly like a full prefill."""
    import threading

    from vllm.v1.request import RequestStatus

    prefix, suffix, kv = _prompt_kv(smol)
    plain, _ = _run(vx, None, prefix, suffix, salt="late-plain")
    a_tokens: list[int] = []
    b_out: dict = {}
    stop_a = threading.Event()

    def run_a():
        # A streams until the test stops it (closing the generator aborts the request), so a
        # slow machine cannot finish A before B has even started waiting
        for ev in vx.generate(None, tuple(smol.encode("Count slowly:")), (smol.encode(" 1,")[0],),
                              SamplingParams(max_tokens=4000), salt="late-a"):
            if isinstance(ev, TokenEvent):
                a_tokens.append(ev.token_id)
            if stop_a.is_set():
                break

    def run_b():
        b_out["result"] = _run(vx, "late-b", prefix, suffix, salt="late-b", kv_load="async")

    sched = vx.core.scheduler
    a = threading.Thread(target=run_a, daemon=True)
    a.start()
    deadline = time.monotonic() + 120
    while not a_tokens:
        assert time.monotonic() < deadline and a.is_alive(), "stream A produced no token"
        time.sleep(0.01)
    b = threading.Thread(target=run_b, daemon=True)
    b.start()
    while not any(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in list(sched.requests.values())):
        assert time.monotonic() < deadline and b.is_alive(), "B never waited for its KV"
        time.sleep(0.005)
    at_wait = len(a_tokens)
    while len(a_tokens) < at_wait + 3:            # A decodes while B's block has not even been sent
        assert time.monotonic() < deadline and a.is_alive(), f"A stalled at {len(a_tokens)} tokens while B waited"
        time.sleep(0.005)
    assert any(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in list(sched.requests.values()))
    sender.send(vx.address, encode_block("late-b", MODEL, kv), timeout=30)
    b.join(timeout=120)
    stop_a.set()
    a.join(timeout=120)
    assert not b.is_alive() and not a.is_alive()
    gone = time.monotonic() + 30                  # the stopped stream was aborted, not left running
    while sched.requests and time.monotonic() < gone:
        time.sleep(0.05)
    assert not sched.requests, list(sched.requests)
    got, s = b_out["result"]
    assert got == plain and s.fallbacks == () and s.loaded_tokens == len(prefix), s


def test_repeated_composed_prefix_hits_vllm_prefix_cache(smol, vx, sender, one_torch_thread):
    prefix, suffix, kv = _prompt_kv(smol)
    sender.send(vx.address, encode_block("rep-1", MODEL, kv), timeout=30)
    first, s1 = _run(vx, "rep-1", prefix, suffix, salt="composed-recipe-A")
    # same recipe again: vLLM's APC holds the prefix's full blocks, so the connector moves only
    # the tail; a block is still offered (the prefill worker does not know what APC holds)
    sender.send(vx.address, encode_block("rep-2", MODEL, kv), timeout=30)
    again, s2 = _run(vx, "rep-2", prefix, suffix, salt="composed-recipe-A")
    assert again == first and s2.fallbacks == ()
    assert s2.cached_tokens >= (len(prefix) // vx.block_size) * vx.block_size, s2
    # another salt (an exact request, another tenant) does not see those blocks
    _, s3 = _run(vx, None, prefix, suffix, salt="exact-tenant-B")
    assert s3.cached_tokens == 0, s3


_FAIL_SCRIPT = textwrap.dedent(f"""
    import sys
    from decode_workers.vllm_engine import VllmDecodeExecutor
    from decode_workers.vllm_settings import VllmEngineConfig
    from kvruntime.messages.decode import SamplingParams
    vx = VllmDecodeExecutor(VllmEngineConfig({MODEL!r}, dtype="float32", load_failure_policy="fail",
                                             receive_timeout_s=1.0, kv_cache_gib=1, max_model_len=2048))
    for mode in ("async", "sync"):
        try:
            list(vx.generate("never-sent-" + mode, tuple(range(1, 200)), (42, 43), SamplingParams(max_tokens=4),
                             kv_load=mode))
            print("NO ERROR", mode)
        except RuntimeError as exc:
            print("ERROR:", mode, exc)
    print("AFTER:", type(list(vx.generate(None, tuple(range(1, 50)), (42,), SamplingParams(max_tokens=3)))[-1]).__name__)
    vx.stop()
""")


@pytest.fixture(scope="module", autouse=True)
def fail_policy_run(request, tmp_path_factory):
    """The ``fail`` policy's engine runs in a process of its own (one vLLM engine per process),
    started as the module starts: its start-up (tens of seconds, one core) overlaps the tests on
    the shared engine instead of adding to them. ``(process, its output directory)``; None when
    test_fail_policy_... is not selected. Killed by PID if it is still running at the end."""
    wanted = "test_fail_policy_fails_the_request_with_a_clear_error"
    if not any(it.name == wanted and it.module is request.module for it in request.session.items):
        yield None
        return
    d = tmp_path_factory.mktemp("fail-policy")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    with open(d / "stdout", "w") as out, open(d / "stderr", "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", _FAIL_SCRIPT], stdout=out, stderr=err, env=env)
    try:
        yield proc, d
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)


def test_fail_policy_fails_the_request_with_a_clear_error(fail_policy_run):
    """``fail``: a missing block ends the request with an error naming the reason, under both
    load modes, and the engine goes on serving (own process: one vLLM engine per process)."""
    proc, d = fail_policy_run
    rc = proc.wait(timeout=600)
    stdout = (d / "stdout").read_text()
    out = stdout + (d / "stderr").read_text()[-3000:]
    assert rc == 0, out
    for mode in ("async", "sync"):
        assert f"ERROR: {mode} prefix KV unavailable (kv_load_failed) and kv load failure policy is 'fail'" \
            in stdout, out
    assert "AFTER: DecodeSummary" in stdout, out          # the engine still serves


def test_prefix_wholly_in_apc_moves_nothing_and_drops_the_block(smol, vx, sender, one_torch_thread):
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvtransport.transfer.interface import TransferState
    prefix, suffix, kv = _prompt_kv(smol)
    aligned = (len(prefix) // vx.block_size) * vx.block_size             # block-aligned: APC can hold all of it
    prefix, kv = prefix[:aligned], kv.slice(0, aligned)                  # (a causal prefix's KV is its head)
    sender.send(vx.address, encode_block("aligned-1", MODEL, kv), timeout=30)
    first, s1 = _run(vx, "aligned-1", prefix, suffix, salt="aligned")
    assert s1.loaded_tokens == len(prefix) and s1.fallbacks == ()
    sender.send(vx.address, encode_block("aligned-2", MODEL, kv), timeout=30)
    inbox = get_kv_transfer_group().inbox                     # the worker-side connector (same process)
    assert inbox.state("aligned-2") is TransferState.DONE
    again, s2 = _run(vx, "aligned-2", prefix, suffix, salt="aligned")
    assert again == first and s2.fallbacks == () and s2.loaded_tokens == 0
    assert s2.cached_tokens >= len(prefix)
    # claimed and dropped (off the step, by the async loader), not left to expire
    deadline = time.monotonic() + 30
    while inbox.state("aligned-2") is not TransferState.PENDING and time.monotonic() < deadline:
        time.sleep(0.01)
    assert inbox.state("aligned-2") is TransferState.PENDING


def test_prefix_held_by_vllm_is_not_sent_again(smol, vx, sender, one_torch_thread):
    """Ship nothing twice: ``held_prefix`` reads what vLLM's prefix cache holds of a prefix (whole
    blocks, per salt); a block carrying only the rest (positions from there) is loaded into the
    remaining slots and decodes exactly like the full block."""
    prefix, suffix, kv = _prompt_kv(smol)
    if len(prefix) % vx.block_size == 0:
        prefix, kv = prefix[:-1], kv.slice(0, len(prefix) - 1)   # a partial last block: the tail must be loaded
    other = smol.encode("Which item is the cheapest? Answer briefly.")
    assert vx.held_prefix(tuple(prefix), "held") == 0
    full = encode_block("held-1", MODEL, kv)
    sender.send(vx.address, full, timeout=30)
    _run(vx, "held-1", prefix, suffix, salt="held")
    held = vx.held_prefix(tuple(prefix), "held")
    assert held == (len(prefix) // vx.block_size) * vx.block_size > 0
    assert vx.held_prefix(tuple(prefix), "another-salt") == 0
    part = encode_block("held-2", MODEL, kv.slice(held))
    assert part.header.positions[0] == held and part.header.payload_bytes < full.header.payload_bytes // 4
    sender.send(vx.address, part, timeout=30)
    got, s2 = _run(vx, "held-2", prefix, other, salt="held")          # another suffix: APC holds `held` tokens
    assert s2.fallbacks == () and s2.loaded_tokens == len(prefix) - held
    sender.send(vx.address, encode_block("held-3", MODEL, kv), timeout=30)
    want, s3 = _run(vx, "held-3", prefix, other, salt="fresh-salt")     # the whole block, nothing cached
    assert s3.loaded_tokens == len(prefix) and got == want


def test_vllm_sampling_params_match_the_reference_decode(vx, smol, one_torch_thread):
    """Penalties, logit bias, stop strings and log-probs mean the same in both decode engines."""
    from decode_workers.executor import DecodeExecutor

    ref = DecodeExecutor(smol, transport=None)
    ids = smol.encode("1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3,")
    banana = smol.encode(" banana")[0]
    for sp in (SamplingParams(max_tokens=12, frequency_penalty=2.0, presence_penalty=2.0, logprobs=3),
               SamplingParams(max_tokens=3, logit_bias=((banana, 100.0),)),
               SamplingParams(max_tokens=12, stop=(" 3",))):
        a = list(ref.generate(None, tuple(ids[:-1]), (ids[-1],), sp))
        b = list(vx.generate(None, tuple(ids[:-1]), (ids[-1],), sp))
        assert [e.token_id for e in a[:-1]] == [e.token_id for e in b[:-1]], sp
        assert a[-1].text == b[-1].text and a[-1].finish_reason == b[-1].finish_reason, (a[-1], b[-1])
        if sp.logprobs:
            for x, y in zip(a[:-1], b[:-1]):
                assert abs(x.logprob - y.logprob) < 1e-2
                assert [i for i, _ in x.top_logprobs] == [i for i, _ in y.top_logprobs]
    assert b[-1].finish_reason == "stop" and " 3" not in b[-1].text
