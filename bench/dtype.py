"""Reference engine in bfloat16 against float32, side by side in one process: prefill speed and
fidelity of the next-token distribution.

Run: ``python -m bench.dtype [--model smollm2-135m] [--sizes 1024 4096] [--reps 2] [--threads 1]``.

Per context size: the full prefill (``kvruntime.ops.recompute``, as a prefill worker runs it) of
the same tokens in each dtype, repetitions interleaved so both see the same machine state (median
seconds). Fidelity, teacher-forced over every position of the first ``--fidelity-tokens`` tokens
(one forward per dtype, all logits): top-1 agreement with float32, mean and max KL(fp32 || bf16)
in nats; plus, per size, the relative error of the whole KV cache and whether the last token's
argmax agrees. Text: the shipped evaluation passages (repeated where a size needs more tokens).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def _kl_top1(ref_logits: torch.Tensor, logits: torch.Tensor) -> tuple[float, float, float]:
    """(top-1 agreement, mean KL, max KL) of ``logits`` [n, vocab] against ``ref_logits``."""
    lp_ref = torch.log_softmax(ref_logits.float(), dim=-1)
    lp = torch.log_softmax(logits.float(), dim=-1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
    agree = (ref_logits.argmax(-1) == logits.argmax(-1)).float().mean()
    return float(agree), float(kl.mean()), float(kl.max())


def main(argv=None) -> int:
    from bench.progress import progress
    from kvruntime.engine import ReferenceEngine
    from kvruntime.fidelity.cases import load_passages
    from kvruntime.ops import recompute

    ap = argparse.ArgumentParser(prog="python -m bench.dtype")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--fidelity-tokens", type=int, default=1024)
    a = ap.parse_args(argv)
    if a.reps < 1 or min(a.sizes) < 16 or a.fidelity_tokens < 16:
        ap.error("--reps >= 1, every size >= 16, --fidelity-tokens >= 16")
    torch.set_num_threads(a.threads)
    ref = ReferenceEngine(a.model, dtype="float32", threads=a.threads)
    low = ReferenceEngine(a.model, dtype=a.dtype, threads=a.threads)
    passages = "\n\n".join(load_passages().values())
    base = ref.encode(passages)
    need = max(*a.sizes, a.fidelity_tokens)
    ids = (base * (need // len(base) + 1))[:need]

    with torch.inference_mode():                       # teacher-forced fidelity at every position
        x = torch.tensor([ids[:a.fidelity_tokens]])
        l32 = ref.model(input_ids=x, logits_to_keep=0).logits[0]
        llo = low.model(input_ids=x, logits_to_keep=0).logits[0]
    agree, kl_mean, kl_max = _kl_top1(l32, llo)
    del l32, llo

    rows = []
    for size in progress(a.sizes, "context sizes"):
        t32, tlo = [], []
        for _ in range(a.reps):
            t = time.perf_counter()
            o32 = recompute(ref, ids[:size])
            t32.append(time.perf_counter() - t)
            t = time.perf_counter()
            olo = recompute(low, ids[:size])
            tlo.append(time.perf_counter() - t)
        kv_err = float((olo.kv.data.float() - o32.kv.data).norm() / o32.kv.data.norm())
        same_last = int(olo.logits.argmax()) == int(o32.logits.argmax())
        rows.append((size, statistics.median(t32), statistics.median(tlo), kv_err, same_last,
                     o32.kv.nbytes, olo.kv.nbytes))
    print(f"# python -m bench.dtype --model {a.model} --dtype {a.dtype} --sizes {' '.join(map(str, a.sizes))} "
          f"--reps {a.reps} --threads {a.threads} --fidelity-tokens {a.fidelity_tokens}")
    print(f"# self-test rel. error: float32 {ref.rope.self_test_error:.2e}, {a.dtype} {low.rope.self_test_error:.2e}")
    print(f"| context tokens | float32 prefill s | {a.dtype} prefill s | speed-up | KV MiB fp32 -> {a.dtype} "
          f"| KV rel. error | last-token argmax same |")
    print("|---|---|---|---|---|---|---|")
    for size, s32, slo, err, same, b32, blo in rows:
        print(f"| {size} | {s32:.2f} | {slo:.2f} | {s32 / slo:.2f}x | {b32 / 2**20:.1f} -> {blo / 2**20:.1f} "
              f"| {err:.2e} | {'yes' if same else 'no'} |")
    print(f"\nnext-token fidelity over {a.fidelity_tokens} teacher-forced positions: top-1 agreement "
          f"{agree:.4f}, KL(fp32 || {a.dtype}) mean {kl_mean:.2e} nats, max {kl_max:.2e} nats")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
