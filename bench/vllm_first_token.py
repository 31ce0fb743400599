"""Where vLLM's first token after a kvnotes KV load goes, next to vLLM's own exact prefix hit, in
one process (issue 47 item 3): one vLLM decode engine with the kvnotes connector (its own gRPC
inbox), a block pushed to it over gRPC, then the request; and the same prompt recomputed once and
asked again (vLLM's exact hit), interleaved per repetition.

    python -m bench.vllm_first_token [--sizes 1024 4096] [--reps 3] [--variants async async-poll sync] [--json FILE]

Variants, interleaved per repetition: ``async`` (the default load; the step loop waits for the
load's end), ``async-poll`` (the same with the step loop polling every 2 ms, as before issue 47),
``sync`` (the load inside the step that runs the suffix), and vLLM's ``exact_hit``.

Stages of a loaded request (seconds, medians): ``send`` (the push, before the request), ``receive``
(the connector's claim), ``decode`` (the block's header / CRC checks and tensor view), ``write``
(every layer into vLLM's paged cache: ``PagedCacheWriter.write``), ``steps`` (engine steps from the
submit to the first token: how many, and the time of the one that ran the suffix), ``first_token``
(submit to first token, what ``DecodeSummary`` reports); then the same prompt and salt again
(vLLM's exact hit on the blocks the load wrote). The exact hit's ``first_token`` and its
suffix step are the baseline; ``bytes / write`` is the write's rate, beside the copy rate of this
machine (a copy of the same bytes, warm)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid

from kvtransport.transfer.blocks import encode_block
from kvtransport.transfer.grpc_transport import GrpcTransport


def _instrument():
    """Wrap the connector's decode + write and the engine step; returns the record dict."""
    from decode_workers import vllm_adapter, vllm_connector_worker as cw
    rec = {"write": [], "decode": [], "steps": []}
    real_write, real_decode = cw.ConnectorWorker._write, cw.decode_block

    def timed_write(self, spec, kv):
        t = time.perf_counter()
        real_write(self, spec, kv)
        rec["write"].append((time.perf_counter() - t, kv.data.nbytes))

    def timed_decode(block, **kw):
        t = time.perf_counter()
        out = real_decode(block, **kw)
        rec["decode"].append(time.perf_counter() - t)
        return out

    cw.ConnectorWorker._write, cw.decode_block = timed_write, timed_decode
    return rec, vllm_adapter


def _wrap_step(vx, rec):
    real = vx.engine.step

    def step():
        t = time.perf_counter()
        out = real()
        rec["steps"].append((t, time.perf_counter() - t, any(o.outputs and o.outputs[0].token_ids for o in out)))
        return out
    vx.engine.step = step


def _first(vx, rec, tid, prefix, suffix, salt, kv_load):
    from kvruntime.messages.decode import DecodeSummary, SamplingParams
    rec["steps"].clear()
    t0 = time.perf_counter()
    evs = list(vx.generate(tid, tuple(prefix), tuple(suffix), SamplingParams(max_tokens=1), salt=salt, kv_load=kv_load))
    summary = evs[-1]
    assert isinstance(summary, DecodeSummary)
    stages = dict(summary.stages)
    # steps up to the one that produced the first token; that step ran the suffix
    steps = [s for s in rec["steps"] if s[0] >= t0]
    upto = next((i for i, s in enumerate(steps) if s[2]), len(steps) - 1)
    return {"first_token": stages.get("first_token", 0.0), "receive": stages.get("receive", 0.0),
            "load": stages.get("load", 0.0), "steps": upto + 1, "suffix_step": steps[upto][1] if steps else 0.0,
            "other_steps": sum(s[1] for s in steps[:upto]), "fallbacks": list(summary.fallbacks),
            "loaded": summary.loaded_tokens, "cached": summary.cached_tokens}


VARIANTS = ("async", "async-poll", "sync")   # async-poll: the step loop polling every 2 ms (before issue 47)


def _load_once(vx, rec, tx, ref, kv, prefix, suffix, variant):
    """Push the block, run the request with ``variant``'s load, then the same prompt and salt again."""
    from decode_workers import vllm_engine
    poll = variant == "async-poll"
    if poll:                                          # the old loop: no wake-up, a 2 ms poll
        vx._unhook()
        vllm_engine._KV_WAIT_S = 0.002
    try:
        tid = uuid.uuid4().hex
        t = time.perf_counter()
        tx.send(vx.address, encode_block(tid, ref.spec.name, kv), timeout=60)
        send = time.perf_counter() - t
        rec["write"].clear(), rec["decode"].clear()
        salt = uuid.uuid4().hex
        one = _first(vx, rec, tid, prefix, suffix, salt, "sync" if variant == "sync" else "async")
        # the same prompt and salt again: vLLM's exact hit on the blocks the load wrote
        one["hit_after"] = _first(vx, rec, None, prefix, suffix, salt, None)["first_token"]
        one.update(send=send, write=sum(w for w, _ in rec["write"]), decode=sum(rec["decode"]))
        return one
    finally:
        if poll:
            from decode_workers.vllm_async_load import on_load_done
            vx._unhook = on_load_done(vx._load_done)
            vllm_engine._KV_WAIT_S = 0.05


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.vllm_first_token")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sizes", type=int, nargs="*", default=[1024, 4096])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--suffix", type=int, default=8)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    rec, vllm_adapter = _instrument()
    import torch
    from decode_workers.vllm_engine import VllmDecodeExecutor
    from decode_workers.vllm_settings import VllmEngineConfig
    from kvruntime.engine import ReferenceEngine
    from kvruntime.ops import recompute
    from bench.decode_leg import copy_gbs

    ref = ReferenceEngine(args.model, threads=1)
    vx = VllmDecodeExecutor(VllmEngineConfig(args.model, dtype="float32", kv_cache_gib=1,
                                             max_model_len=max(args.sizes) + args.suffix + 16, receive_timeout_s=60))
    _wrap_step(vx, rec)
    tx = GrpcTransport()
    rows = []
    try:
        g = torch.Generator().manual_seed(0)
        for size in args.sizes:
            ids = torch.randint(100, 20000, (size + args.suffix,), generator=g).tolist()
            prefix, suffix = ids[:size], ids[size:]
            kv = recompute(ref, prefix, logits=False).kv
            row = {"size": size, "bytes": kv.nbytes, "copy_gbs": copy_gbs(kv.nbytes)}
            runs = {v: [] for v in (*args.variants, "exact_hit")}
            for r in range(-1, args.reps):                      # rep -1: an untimed warm-up
                order = [*args.variants, "exact_hit"]
                order = order[r % len(order):] + order[:r % len(order)]     # interleaved, rotated
                for v in order:
                    if v == "exact_hit":
                        salt = uuid.uuid4().hex
                        _first(vx, rec, None, prefix, suffix, salt, None)      # cold: vLLM computes and caches it
                        one = _first(vx, rec, None, prefix, suffix, salt, None)
                    else:
                        one = _load_once(vx, rec, tx, ref, kv, prefix, suffix, v)
                    if r >= 0:
                        runs[v].append(one)
            row.update({v: _median(x) for v, x in runs.items()})
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        tx.stop()
        vx.stop()
        torch.set_num_threads = vllm_adapter._set_num_threads
    _table(rows, args.variants)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "load_average": os.getloadavg(), "argv": sys.argv[1:]}, f, indent=1)
    return 0


def _median(runs: list[dict]) -> dict:
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float))]
    out = {k: statistics.median(r[k] for r in runs) for k in keys}
    out["fallbacks"] = sorted({f for r in runs for f in r["fallbacks"]})
    return out


def _table(rows: list[dict], modes) -> None:
    print(f"load average {os.getloadavg()[0]:.1f} (1 min); seconds, medians")
    print("| size | path | first token | receive | decode | write (GB/s) | steps | other steps | suffix step | "
          "exact hit's suffix step | exact hit on the loaded blocks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        h = r["exact_hit"]
        print(f"| {r['size']} | exact hit | {h['first_token']:.3f} | | | | {h['steps']:.0f} | {h['other_steps']:.3f} | "
              f"{h['suffix_step']:.3f} | | |")
        for m in modes:
            x = r[m]
            rate = r["bytes"] / x["write"] / 1e9 if x["write"] else 0.0
            print(f"| {r['size']} | load {m} | {x['first_token']:.3f} | {x['receive']:.3f} | {x['decode']:.3f} | "
                  f"{x['write']:.3f} ({rate:.1f}; copy {r['copy_gbs']:.1f}) | {x['steps']:.0f} | "
                  f"{x['other_steps']:.3f} | {x['suffix_step']:.3f} | {h['suffix_step']:.3f} | {x['hit_after']:.3f} |")


if __name__ == "__main__":
    sys.exit(main())
