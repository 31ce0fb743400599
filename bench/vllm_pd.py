"""The decode leg of a composed prompt through kvnotes, side by side with vLLM's own
disaggregated prefill/decode (two vLLM servers with ``NixlConnector``), on the same prompts.

Run: ``python -m bench.vllm_pd [--quick] [--json] [--sizes 1024 4096 7800] [--reps 3]``

One run, two phases one after the other (3 vLLM engines at once would not fit next to four other
users of this 24 GiB machine, and vLLM P/D's idle NIXL progress threads busy-poll ~2 cores, which
would slow whatever runs beside them):

1. **kvnotes** (in a local Ray cluster, as the cluster runs it): a prefill actor (reference engine,
   LMCache tier with the chunks precompiled, :class:`~prefill_workers.executor.PrefillExecutor`
   with a NIXL :class:`~kvtransport.transfer.endpoints.Sender`) builds the composed prefix by its
   reposition plan and pushes it; a decode actor (:class:`~decode_workers.vllm_engine.VllmDecodeExecutor`
   with the kvnotes connector and a NIXL :class:`~kvtransport.transfer.endpoints.Receiver`) loads it and
   computes the question. **Decode leg** = from the prefix KV being built (the end of the
   prefill leg) to the first token: serialise into registered memory + NIXL transfer (receiver
   pull, CRC) + claim and load into vLLM's paged cache + the question's forward + first token.
2. **vLLM P/D** (:mod:`bench.pd_servers`): producer + consumer servers and a proxy; the same
   prompt token ids. **Decode leg** = from the decode request being sent to its first streamed
   token: NIXL pull + load into the paged cache + first token. Its prefill leg is a full prefill
   (vLLM has no chunk reuse); a unique ``cache_salt`` per request keeps both servers' prefix
   caches from answering.

Both systems run the dtype kvnotes' vLLM decode engine runs (``ClusterConfig.dtype``, float32 by
default) and move their KV in it. Each size gets one untimed warm-up request per system (first
NIXL pulls are slow). Progress lines go to stderr; the table (or ``--json`` lines) to stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import time
import uuid
from pathlib import Path

from bench.progress import progress

SIZES = (1024, 4096, 7800)


def _log(msg: str) -> None:
    print(f"[vllm_pd] {msg}", file=sys.stderr, flush=True)


def _leg_line(system: str, tokens: int, rows: list[dict], warmup: int) -> str:
    warm = ", ".join(f"{r['decode_leg']:.2f}" for r in rows[:warmup]) or "none"
    return (f"{system} {tokens} tokens: decode leg median {statistics.median(r['decode_leg'] for r in rows[warmup:]):.3f} s "
            f"(warm-ups {warm} s)")


# ---- kvnotes: two Ray actors, as the cluster places them --------------------------------------
class PrefillSide:
    """Prefill actor: reference engine + LMCache tier + executor with a NIXL Sender."""

    def __init__(self, model: str, dtype: str, threads: int, transport: str):
        import torch
        torch.set_num_threads(threads)
        from kvruntime.engine import ReferenceEngine
        from kvruntime.ops.frame import chat_frame
        from kvtransport.transfer.endpoints import Sender
        from kvruntime.config import TierConfig
        from kvtransport.tier.lmcache_store import LMCacheStore
        from prefill_workers.executor import PrefillExecutor
        from prefill_workers.tier_reads import PrefillTier

        self.engine = ReferenceEngine(model, dtype=dtype, threads=threads)
        self.store = LMCacheStore.for_engine(self.engine, TierConfig(cpu_bytes=1 << 30))
        self.source = PrefillTier(self.store, self.engine)
        self.prefill = PrefillExecutor(self.engine, self.source, Sender(transport), transfer_timeout=120.0)
        self.chunk_pos = 0 if self.engine.bos_id is None else 1
        self.pre, self.post = chat_frame(self.engine), self.engine.spec.chat_user_suffix

    def prompts(self, size: int, n: int, seed: int) -> dict:
        """``n`` composed prompts of ~``size`` tokens (chunks shuffled per prompt, a question each),
        their chunks precompiled into the tier (not timed)."""
        import random

        from bench.vllm_side_by_side import BENCH_SALT, _chunks
        from kvruntime.fidelity.cases import load_passages
        from kvruntime.messages.plan import KVRef
        from kvruntime.ops import precompile_chunk

        k = {1024: 2, 2048: 3, 4096: 4}.get(size, 6)
        chunks = _chunks(self.engine, list(load_passages().values()), size - len(self.pre) - 24, k, f"pd{size}")
        for ids in chunks.values():
            self.source.put(KVRef(tuple(ids), self.chunk_pos, BENCH_SALT), precompile_chunk(self.engine, ids))
        questions = ["Summarise the key facts above in one sentence.", "Which organisation is mentioned first?",
                     "List two numbers that appear above.", "What is the main topic of the last section?"]
        rng, out = random.Random(seed), []
        for r in range(n):
            order = list(chunks)
            rng.shuffle(order)
            q = self.engine.encode(questions[r % len(questions)] + self.post)
            out.append({"order": order, "q": q, "ids": self.pre + [t for c in order for t in chunks[c]] + q})
        return {"chunks": chunks, "prompts": out}

    def plan(self, model: str, chunks: dict, order: list[str], q: list[int]):
        from bench.vllm_side_by_side import BENCH_SALT
        from kvruntime.messages.plan import KVRef, PlanKind, Policy, RequestPlan, SegmentPlan
        steps = [SegmentPlan(kind=PlanKind.RECOMPUTE, source="text", token_ids=tuple(self.pre), position=0,
                             computed=len(self.pre), reused=0)]
        pos = len(self.pre)
        for name in order:
            ids = chunks[name]
            steps.append(SegmentPlan(kind=PlanKind.REPOSITION, source=f"skill:{name}", token_ids=tuple(ids),
                                     position=pos, computed=1, reused=len(ids) - 1,
                                     kv=KVRef(tuple(ids), self.chunk_pos, BENCH_SALT), seam_tokens=1))
            pos += len(ids)
        return RequestPlan(uuid.uuid4().hex, model, Policy.BALANCED, tuple(steps), tuple(q))

    def execute(self, plan, endpoint, transfer_id: str, credential: str) -> dict:
        t0 = time.perf_counter()
        res = self.prefill.execute(plan, endpoint, transfer_id, credential=credential)
        return {"start": t0, "built_at": t0 + res.seconds, "built": res.seconds, "bytes": res.transfer_bytes,
                "transport": res.transport, "ok": res.transferred, "fallbacks": list(res.stats.fallbacks),
                "stages": dict(res.stats.stages), "computed": res.stats.computed}

    def stop(self) -> None:
        self.prefill.transport.stop()
        self.store.close()


class DecodeSide:
    """Decode actor: kvnotes' vLLM decode engine with the kvnotes connector and a NIXL Receiver."""

    def __init__(self, model: str, dtype: str, threads: int, transport: str, kv_gib: int):
        from decode_workers.vllm_engine import VllmDecodeExecutor
        from decode_workers.vllm_settings import VllmEngineConfig
        from kvtransport.transfer.endpoints import Receiver
        self.receiver = Receiver(transport, model, dtype, bind="127.0.0.1", advertise="127.0.0.1")
        self.vllm = VllmDecodeExecutor(VllmEngineConfig(model, dtype=dtype, kv_cache_gib=kv_gib, max_model_len=8192,
                                                        threads=threads, receive_timeout_s=120.0), self.receiver)

    def endpoint(self):
        return self.receiver.endpoint

    def expect(self, grant) -> None:
        self.receiver.expect(grant)

    def generate(self, transfer_id: str, prefix: tuple, suffix: tuple, max_tokens: int, salt: str) -> dict:
        from kvruntime.messages.decode import DecodeSummary, SamplingParams, TokenEvent
        first, toks, summary = None, [], None
        for ev in self.vllm.generate(transfer_id, prefix, suffix, SamplingParams(max_tokens=max_tokens), salt=salt):
            if isinstance(ev, TokenEvent):
                first = first if first is not None else time.perf_counter()
                toks.append(ev.token_id)
            elif isinstance(ev, DecodeSummary):
                summary = ev
        return {"first_at": first, "tokens": toks, "loaded": summary.loaded_tokens, "fallbacks": list(summary.fallbacks),
                "stages": dict(summary.stages)}

    def stop(self) -> None:
        self.vllm.stop()
        self.receiver.stop()


def kvnotes_request(pre, dec, model: str, dtype: str, prompt: dict, chunks: dict, max_tokens: int) -> dict:
    import ray

    from kvruntime.messages.transfer import TransferGrant
    plan = ray.get(pre.plan.remote(model, chunks, prompt["order"], prompt["q"]))
    tid = uuid.uuid4().hex
    grant, cred = TransferGrant.issue(tid, model, dtype, plan.prefix_ids, 0)
    ray.get(dec.expect.remote(grant))
    sent = ray.get(pre.execute.remote(plan, ray.get(dec.endpoint.remote()), tid, cred))
    if not sent["ok"] or sent["fallbacks"] or sent["transport"] != "nixl":
        raise RuntimeError(f"kvnotes push did not go over NIXL cleanly: {sent}")
    got = ray.get(dec.generate.remote(tid, plan.prefix_ids, plan.suffix_ids, max_tokens, uuid.uuid4().hex))
    if got["fallbacks"] or got["loaded"] != len(plan.prefix_ids) or got["first_at"] is None:
        raise RuntimeError(f"kvnotes load fell back or loaded {got['loaded']}/{len(plan.prefix_ids)}: {got['fallbacks']}")
    st, ds = sent["stages"], got["stages"]
    load = ds.get("receive", 0.0) + ds.get("load", 0.0)
    leg = got["first_at"] - sent["built_at"]
    xfer = st.get("serialise", 0.0) + st.get("transfer", 0.0)
    return {"prefill_leg": sent["built"], "decode_leg": leg, "tokens": got["tokens"], "bytes": sent["bytes"],
            "serialise": st.get("serialise", 0.0), "transfer": st.get("transfer", 0.0), "load": load,
            "first_token": max(0.0, leg - xfer - load)}


def run_kvnotes(args, sizes: list[int]) -> tuple[dict, dict]:
    """Phase 1: per size, the prompts (built here, reused by phase 2) and kvnotes' results."""
    import ray

    env = {"PYTHONPATH": os.getcwd(), "PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false",
           "OMP_NUM_THREADS": str(args.threads)}
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 << 20, log_to_driver=False,
             runtime_env={"env_vars": env})
    try:
        dec = ray.remote(num_cpus=0)(DecodeSide).remote(args.model, args.dtype, args.threads, "nixl", args.kv_gib)
        ray.get(dec.endpoint.remote())                 # vLLM up before the prefill actor loads LMCache
        pre = ray.remote(num_cpus=0)(PrefillSide).remote(args.model, args.dtype, args.threads, "nixl")
        prompts, results = {}, {}
        for size in progress(sizes, "kvnotes sizes"):
            p = ray.get(pre.prompts.remote(size, args.reps + args.warmup, size))
            prompts[size] = p
            rows = [kvnotes_request(pre, dec, args.model, args.dtype, x, p["chunks"], args.max_tokens)
                    for x in p["prompts"]]
            results[size] = rows[args.warmup:]         # the first ones are warm-ups
            _log(_leg_line("kvnotes", len(p["prompts"][0]["ids"]), rows, args.warmup))
        for a in (pre, dec):
            ray.get(a.stop.remote())
        return prompts, results
    finally:
        ray.shutdown()


def run_vllm_pd(args, prompts: dict) -> dict:
    """Phase 2: the same prompts through vLLM's own P/D."""
    from bench.pd_servers import PDServers, pd_request
    from kvruntime.checkpoint import ensure_checkpoint
    from kvruntime.models import get_model_spec

    ckpt = str(ensure_checkpoint(get_model_spec(args.model)))
    _own_signals()             # ray.init/shutdown replaced them: Ctrl-C / SIGTERM must reach PDServers.__exit__
    results = {}
    t = time.perf_counter()
    with PDServers(ckpt, args.model, args.dtype, kv_gib=args.kv_gib, threads=args.threads,
                   log_dir=Path(args.out).parent / "vllm_pd_logs", quiet_nixl=args.vllm_nixl == "quiet") as srv:
        _log(f"vLLM P/D servers ready in {time.perf_counter() - t:.0f} s "
             f"(producer pid {srv.producer.proc.pid}, consumer pid {srv.consumer.proc.pid})")
        for size in progress(list(prompts), "vLLM P/D sizes"):
            rows = [pd_request(srv, x["ids"], args.max_tokens, uuid.uuid4().hex) for x in prompts[size]["prompts"]]
            results[size] = rows[args.warmup:]
            _log(_leg_line("vLLM P/D", len(prompts[size]["prompts"][0]["ids"]), rows, args.warmup))
    return results


def summarise(prompts: dict, kv: dict, pd: dict) -> list[dict]:
    med = statistics.median
    rows = []
    for size in prompts:
        k, v = kv[size], pd[size]
        row = {"tokens": len(prompts[size]["prompts"][0]["ids"]), "reps": len(k),
               "kvnotes_decode_leg": med(r["decode_leg"] for r in k), "vllm_pd_decode_leg": med(r["decode_leg"] for r in v),
               "kvnotes_serialise": med(r["serialise"] for r in k), "kvnotes_transfer": med(r["transfer"] for r in k),
               "kvnotes_load": med(r["load"] for r in k), "kvnotes_first_token": med(r["first_token"] for r in k),
               "kvnotes_mib": med(r["bytes"] for r in k) / 2**20,
               "vllm_pd_pull_s": med(r["pull_seconds"] for r in v), "vllm_pd_mib": med(r["pull_bytes"] for r in v) / 2**20,
               "kvnotes_prefill_leg": med(r["prefill_leg"] for r in k), "vllm_pd_prefill_leg": med(r["prefill_leg"] for r in v),
               "same_first_token": sum(a["tokens"][:1] == b["tokens"][:1] for a, b in zip(k, v))}
        row["ratio"] = row["kvnotes_decode_leg"] / row["vllm_pd_decode_leg"]
        row["kvnotes_ttft"] = med(r["prefill_leg"] + r["decode_leg"] for r in k)
        row["vllm_pd_ttft"] = med(r["prefill_leg"] + r["decode_leg"] for r in v)
        rows.append(row)
    return rows


def report(r: dict) -> str:
    lines = [f"# decode leg: kvnotes (composed, NIXL) vs vLLM P/D (NixlConnector, {r['vllm_nixl']} NIXL agents): "
             f"{r['model']} {r['dtype']}, "
             f"{r['machine']}", "",
             "| tokens | kvnotes decode leg (s) | vLLM P/D decode leg (s) | kvnotes / vLLM P/D | kvnotes: serialise "
             "/ transfer / load / first token (s) | vLLM P/D pull (s) | KV moved kvnotes / vLLM P/D (MiB) "
             "| prefill leg kvnotes / vLLM P/D (s) | TTFT kvnotes / vLLM P/D (s) | same 1st token |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        lines.append(f"| {x['tokens']} | {x['kvnotes_decode_leg']:.3f} | {x['vllm_pd_decode_leg']:.3f} | {x['ratio']:.2f}x "
                     f"| {x['kvnotes_serialise']:.3f} / {x['kvnotes_transfer']:.3f} / {x['kvnotes_load']:.3f} / "
                     f"{x['kvnotes_first_token']:.3f} | {x['vllm_pd_pull_s']:.3f} | {x['kvnotes_mib']:.0f} / "
                     f"{x['vllm_pd_mib']:.0f} | {x['kvnotes_prefill_leg']:.2f} / {x['vllm_pd_prefill_leg']:.2f} "
                     f"| {x['kvnotes_ttft']:.2f} / {x['vllm_pd_ttft']:.2f} | {x['same_first_token']}/{x['reps']} |")
    return "\n".join(lines)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _own_signals() -> None:
    """Ctrl-C raises KeyboardInterrupt and SIGTERM SystemExit, so every ``finally`` runs (Ray and
    both vLLM servers stopped by PID)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.vllm_pd")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="default: the cluster's (ClusterConfig.dtype), which kvnotes' vLLM decode engine runs")
    ap.add_argument("--sizes", type=int, nargs="*", default=list(SIZES))
    ap.add_argument("--reps", type=int, default=3, help="timed requests per size and system (after one warm-up)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed requests per size and system first "
                    "(vLLM P/D's first NIXL pulls take seconds)")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kv-gib", type=int, default=2, help="paged KV space per vLLM engine (GiB)")
    ap.add_argument("--vllm-nixl", choices=["shipped", "quiet"], default="shipped",
                    help="vLLM P/D's NIXL agents as vLLM creates them (shipped: nixl's progress thread busy-polls a "
                         "core per agent) or with that thread off, as kvnotes' transport runs (quiet)")
    ap.add_argument("--quick", action="store_true", help="1k only, 1 rep (a smoke run)")
    ap.add_argument("--json", action="store_true", help="one JSON object per size on stdout instead of the table")
    ap.add_argument("--out", default="runs/vllm_pd.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.reps, args.warmup = [1024], 1, 1
    if args.dtype is None:
        from kvruntime.config import ClusterConfig
        args.dtype = ClusterConfig().workers.dtype
    if args.reps < 1 or args.warmup < 0 or args.max_tokens < 1 or not args.sizes or any(s < 256 or s > 8000 for s in args.sizes):
        ap.error("--reps >= 1, --warmup >= 0, --max-tokens >= 1 and sizes in 256..8000 required")
    # SIGTERM ends the run like Ctrl-C: the finally blocks stop Ray and both vLLM servers by PID
    _own_signals()
    t0 = time.perf_counter()
    _log(f"phase 1/2: kvnotes (sizes {args.sizes}, {args.reps} reps + {args.warmup} warm-up(s), {args.dtype})")
    prompts, kv = run_kvnotes(args, args.sizes)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)     # phase 1 kept even if phase 2 fails
    Path(args.out).with_suffix(".kvnotes.json").write_text(json.dumps({"kvnotes": kv}, indent=1))
    _log(f"phase 2/2: vLLM P/D on the same prompts ({args.vllm_nixl} NIXL agents)")
    pd = run_vllm_pd(args, prompts)
    import torch
    import vllm
    r = {"model": args.model, "dtype": args.dtype, "vllm_nixl": args.vllm_nixl, "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
         f"{args.threads} thread(s) per engine, vLLM {vllm.__version__} CPU, torch {torch.__version__}",
         "rows": summarise(prompts, kv, pd), "seconds": time.perf_counter() - t0,
         "raw": {"kvnotes": kv, "vllm_pd": pd}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(r, indent=1, default=str))
    if args.json:
        for x in r["rows"]:
            print(json.dumps({"model": r["model"], "dtype": r["dtype"], "vllm_nixl": r["vllm_nixl"], **x}))
    else:
        print(report(r))
        print(f"\n(run took {r['seconds']:.0f} s; raw results in {args.out})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
