"""vLLM (CPU) as the decode engine of a user's checkpoint directory: a Llama-3-style and a
Qwen3-style tiny checkpoint (tests/tiny_checkpoints.py, head_dim 64: what vLLM's CPU attention
supports) are loaded by ``VllmDecodeExecutor`` from the same directory the reference engine reads.
Two requests each: a plain prompt vLLM computes itself, and a prefix composed by kvnotes (two
precompiled chunks repositioned + seam) sent as a KV block over gRPC into vLLM's paged cache
through the kvnotes connector. vLLM's greedy tokens equal the reference engine's, and it stops at the same end-of-turn
tokens, up to a
near-tie (the two candidates' log-probs within NEAR_TIE nats). Each family runs in its own
process (one vLLM engine per process), the two side by side."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed (scripts/dev.sh installs it)")
pytestmark = pytest.mark.slow
NEAR_TIE = 0.05
GREEDY = 8

_SCRIPT = textwrap.dedent('''
    import json, sys, torch
    from kvruntime.engine import ReferenceEngine
    from kvruntime.kv import KVCache
    from kvruntime.messages.decode import DecodeSummary, SamplingParams, TokenEvent
    from kvruntime.ops.frame import chat_frame
    from kvruntime.ops import recompute, precompile_chunk
    from kvruntime.ops.compose import ChunkSegment, TextSegment, compose
    from kvtransport.transfer.blocks import encode_block
    from kvtransport.transfer.grpc_transport import GrpcTransport
    from decode_workers.vllm_engine import VllmDecodeExecutor
    from decode_workers.vllm_settings import VllmEngineConfig

    path, n = sys.argv[1], int(sys.argv[2])
    e = ReferenceEngine(path, dtype="float32", threads=1)
    pre, close = chat_frame(e), e.spec.chat_user_suffix
    a = e.encode("Dana bought headphones on March 3; the store accepts returns within 30 days.\\n\\n")
    b = e.encode("The Varga Museum opens at nine and closes at six, except on Mondays.\\n\\n")
    suffix = e.encode("When does the Varga Museum close?" + close)
    composed = compose(e, [TextSegment(pre), ChunkSegment(precompile_chunk(e, a)), ChunkSegment(precompile_chunk(e, b))],
                       seam_tokens=1).kv
    plain = recompute(e, pre + a + b, logits=False).kv

    def reference(kv):
        m = kv.num_tokens
        out = e.prefill(suffix, torch.arange(m, m + len(suffix)), kv, logits=True)
        kv, logits, toks, lps = KVCache.cat([kv, out.kv]), out.logits, [], []
        for _ in range(n):
            lps.append(torch.log_softmax(logits.float(), -1))
            t = int(torch.argmax(logits))
            if t in e.eos_ids:
                break
            toks.append(t)
            o = e.prefill([t], torch.tensor([kv.num_tokens]), kv, logits=True)
            kv, logits = KVCache.cat([kv, o.kv]), o.logits
        return toks, lps

    x = VllmDecodeExecutor(VllmEngineConfig(path, dtype="float32", receive_timeout_s=30.0, kv_cache_gib=1,
                                            max_model_len=1024))
    out = {"model": e.spec.name, "vllm_max_model_len": x.engine.vllm_config.model_config.max_model_len}
    sender = GrpcTransport()
    for name, kv, tid in (("plain", plain, None), ("composed", composed, "composed-1")):
        if tid:
            sender.send(x.address, encode_block(tid, e.spec.name, kv), timeout=30)
        evs = list(x.generate(tid, tuple(kv.token_ids.tolist()), tuple(suffix), SamplingParams(max_tokens=n),
                              salt=name))
        got = [ev.token_id for ev in evs if isinstance(ev, TokenEvent)]      # an eos ends it, is not emitted
        summary = evs[-1]
        ref, lps = reference(kv)
        j = next((k for k in range(min(len(got), len(ref))) if got[k] != ref[k]), None)
        gap = None
        if j is not None:
            gap = float(lps[j][ref[j]] - lps[j][got[j]])
        out[name] = {"vllm": got, "reference": ref, "eos": sorted(e.eos_ids), "diverges_at": j, "logprob_gap": gap,
                     "loaded_tokens": summary.loaded_tokens, "fallbacks": list(summary.fallbacks),
                     "prefix_tokens": kv.num_tokens}
    x.stop()
    print("RESULT " + json.dumps(out))
''')


FAMILIES = ["llama3", "qwen3"]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """family -> (process, its output directory): every selected family's process is started at
    once, so their start-ups (vLLM's import and engine build, single-threaded, tens of seconds)
    run side by side on the machine's cores instead of one after the other. Killed by PID if
    still running at the end."""
    from tests.tiny_checkpoints import build
    wanted = [f for f in FAMILIES if any(it.module is request.module and getattr(it, "callspec", None)
                                         and it.callspec.params.get("family") == f for it in request.session.items)]
    procs = {}
    try:
        for family in wanted:
            d = tmp_path_factory.mktemp(f"vllm-hf-{family}")
            ckpt = build(d, family, for_vllm=True)
            with open(d / "stdout", "w") as out, open(d / "stderr", "w") as err:
                procs[family] = (subprocess.Popen([sys.executable, "-c", _SCRIPT, str(ckpt), str(GREEDY)],
                                                  stdout=out, stderr=err), d)
        yield procs
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)


@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_decodes_the_checkpoint_directory_like_the_reference_engine(runs, family):
    proc, d = runs[family]
    rc = proc.wait(timeout=560)
    stdout = (d / "stdout").read_text()
    lines = [l for l in stdout.splitlines() if l.startswith("RESULT ")]
    assert rc == 0 and lines, (d / "stderr").read_text()[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    print(family, json.dumps(out))
    assert out["vllm_max_model_len"] == 1024
    for name in ("plain", "composed"):
        r = out[name]
        assert r["vllm"] and r["reference"], r
        if r["diverges_at"] is None:           # the same tokens, ending at the same eos (the same stop set)
            assert r["vllm"] == r["reference"], r
        else:
            assert r["diverges_at"] > 0 or r["logprob_gap"] < NEAR_TIE, r
            assert r["logprob_gap"] < NEAR_TIE, f"{name}: a non-tie divergence {r}"
    assert out["composed"]["fallbacks"] == [] and out["composed"]["loaded_tokens"] == out["composed"]["prefix_tokens"]
    assert out["plain"]["loaded_tokens"] == 0
