"""Do composed requests arriving at a vLLM decode engine stall the streams it is already decoding?

Run: ``python -m bench.decode_stall [--quick] [--out runs/decode_stall.json]``

One vLLM engine (:class:`~decode_workers.vllm_engine.VllmDecodeExecutor`, in process, as in
``bench.vllm_side_by_side``) with the kvnotes connector. A real kvnotes prefill executor
(reference engine + LMCache tier) builds each composed prefix beforehand (on a prefill actor
that is another process; here its CPU would otherwise compete with the decode engine); at
arrival time the block is pushed over real gRPC into the connector's inbox and the request goes
to vLLM. For each load mode (``sync``: the block is claimed, checked and written before the
step's forward; ``async``: vLLM's asynchronous load, the request waits while the others
decode), on the same engine, in the same run, interleaved ``reps`` times:

1. ``streams`` greedy streams with a ``stream_context``-token prompt start and decode;
2. a quiet window measures their decode rate alone (tokens/s summed over the streams);
3. ``arrivals`` composed requests of ``compose_tokens`` tokens arrive ``spacing_s`` apart (push
   + decode request, each in its own thread);
4. from the first arrival to the last composed request's first token, the streams' decode rate
   and their longest gap between two consecutive tokens are measured.

The table gives both modes side by side (medians over reps) and async/sync as ratios. Every
request carries its own vLLM ``cache_salt``, so nothing is served from another's KV.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time
import uuid
from pathlib import Path

from bench.progress import progress
from kvruntime.messages.decode import SamplingParams, TokenEvent

MODES = ("sync", "async")


def _text_ids(engine, tokens: int, seed: int) -> list[int]:
    words = " ".join(f"Crate {seed}-{i} ships {(i * 37 + seed) % 1000} bolts to dock {i % 17}." for i in range(tokens))
    return engine.encode(words)[:tokens]


class Streams:
    """``n`` greedy streams decoding until stopped; every token's arrival time per stream."""

    def __init__(self, h, n: int, context: int, tag: str):
        self.times: list[list[float]] = [[] for _ in range(n)]
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(h, i, context, tag), daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def _run(self, h, i: int, context: int, tag: str) -> None:
        ids = h.pre + _text_ids(h.engine, context - len(h.pre) - 8, 1000 + i) + h.engine.encode("Sum the bolts." + h.post)
        no_eos = tuple((e, -100.0) for e in h.engine.eos_ids)      # keep decoding until stopped
        gen = h.vllm.generate(None, tuple(ids[:-1]), (ids[-1],),
                              SamplingParams(max_tokens=h.max_stream_tokens, logit_bias=no_eos),
                              salt=f"stream-{tag}-{i}-{uuid.uuid4().hex}")
        try:
            for ev in gen:
                if isinstance(ev, TokenEvent):
                    self.times[i].append(time.perf_counter())
                if self._stop.is_set():
                    break
        finally:
            gen.close()                       # aborts the request in vLLM

    def started(self) -> bool:
        return all(self.times)

    def rate(self, a: float, b: float) -> float:
        return sum(sum(a <= t < b for t in ts) for ts in self.times) / (b - a)

    def max_gap(self, a: float, b: float) -> float:
        """Longest pause between two consecutive tokens of any stream that overlaps [a, b]."""
        gaps = [0.0]
        for ts in self.times:
            seq = [t for t in ts if t < a][-1:] + [t for t in ts if a <= t <= b] + [t for t in ts if t > b][:1]
            gaps += [y - x for x, y in zip(seq, seq[1:])]
        return max(gaps)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)


def run_mode(h, mode: str, args, plans, blocks) -> dict:
    streams = Streams(h, args.streams, args.stream_context, mode)
    deadline = time.monotonic() + 600
    while not streams.started():
        if time.monotonic() > deadline:
            raise RuntimeError("the streams never started")
        time.sleep(0.05)
    time.sleep(1.0)                                      # past the streams' own prefills
    q0 = time.perf_counter()
    time.sleep(args.quiet_s)
    q1 = time.perf_counter()
    arrivals: list[dict] = []

    def arrive(plan, block, k: int) -> None:
        rec = {"start": time.perf_counter()}
        tid = block.header.transfer_id
        h.prefill.transport.blocks.send(h.vllm.address, block, timeout=600)     # the push, over gRPC
        rec["pushed"] = time.perf_counter()
        prefix = tuple(t for s in plan.steps for t in s.token_ids)
        for ev in h.vllm.generate(tid, prefix, plan.suffix_ids, SamplingParams(max_tokens=4),
                                  salt=f"arrival-{mode}-{k}-{uuid.uuid4().hex}", kv_load=mode):
            if isinstance(ev, TokenEvent):
                rec.setdefault("first", time.perf_counter())
            else:
                rec["summary"] = ev
        rec.update(fallbacks=list(rec["summary"].fallbacks), loaded=rec["summary"].loaded_tokens,
                   prompt=plan.prompt_tokens)
        arrivals.append(rec)

    threads = []
    for k, (plan, block) in enumerate(zip(plans, blocks)):
        t = threading.Thread(target=arrive, args=(plan, block, k), daemon=True)
        t.start()
        threads.append(t)
        time.sleep(args.spacing_s)
    for t in threads:
        t.join(timeout=600)
    streams.stop()
    if len(arrivals) != len(plans) or any("first" not in a for a in arrivals):
        raise RuntimeError(f"{mode}: a composed request did not finish: {arrivals}")
    a, b = min(x["start"] for x in arrivals), max(x["first"] for x in arrivals)
    return {"mode": mode, "quiet_tok_s": streams.rate(q0, q1), "quiet_max_gap_s": streams.max_gap(q0, q1),
            "arrivals_tok_s": streams.rate(a, b), "arrivals_max_gap_s": streams.max_gap(a, b), "window_s": b - a,
            "compose_ttft_s": [x["first"] - x["start"] for x in arrivals],
            "push_s": [x["pushed"] - x["start"] for x in arrivals],
            "loaded_tokens": [x["loaded"] for x in arrivals], "fallbacks": [x["fallbacks"] for x in arrivals]}


def _args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run, minutes)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1, help="torch/OpenMP threads of vLLM and the prefill engine")
    ap.add_argument("--streams", type=int)
    ap.add_argument("--stream-context", type=int)
    ap.add_argument("--compose-tokens", type=int)
    ap.add_argument("--arrivals", type=int)
    ap.add_argument("--spacing-s", type=float)
    ap.add_argument("--quiet-s", type=float)
    ap.add_argument("--reps", type=int, help="interleaved repetitions of both modes")
    ap.add_argument("--out", default="runs/decode_stall.json")
    args = ap.parse_args()
    q = args.quick
    for k, full, small in (("streams", 4, 2), ("stream_context", 1024, 256), ("compose_tokens", 7800, 2000),
                           ("arrivals", 3, 2), ("spacing_s", 2.0, 1.0), ("quiet_s", 4.0, 2.0), ("reps", 2, 1)):
        if getattr(args, k) is None:
            setattr(args, k, small if q else full)
    return args


def _composed_prefixes(h, args, staging, addr) -> tuple[list, list]:
    """``arrivals + 1`` composed plans and their KV, built and pushed by the real prefill executor
    into ``staging`` (at ``addr``) beforehand; distinct chunks, so no reuse between them."""
    from bench.vllm_side_by_side import BENCH_SALT, _chunks
    from kvruntime.fidelity.cases import load_passages
    from kvruntime.messages.plan import KVRef
    from kvruntime.ops import precompile_chunk
    from kvtransport.transfer.blocks import decode_block

    passages = list(load_passages().values())
    plans, kvs = [], []
    k = max(2, args.compose_tokens // 1300)
    for m in progress(range(args.arrivals + 1), "composed prefixes"):    # distinct chunks: no reuse between them
        chunks = _chunks(h.engine, passages[m % len(passages):] + passages[:m % len(passages)],
                         args.compose_tokens - len(h.pre) - 24, k, f"a{m}")
        for name, ids in chunks.items():               # precompiled into the tier
            h.source.put(KVRef(tuple(ids), h.chunk_pos, BENCH_SALT), precompile_chunk(h.engine, ids))
        qids = h.engine.encode(f"Question {m}: what is the first topic above?" + h.post)
        plans.append(h.compose_plan(list(chunks), chunks, qids, 1))
        tid = uuid.uuid4().hex
        res = h.prefill.execute(plans[-1], addr, tid)  # the real prefill executor builds and pushes it
        if res.stats.fallbacks:
            raise RuntimeError(f"the prefill fell back: {res.stats.fallbacks}")
        kvs.append(decode_block(staging.receive(tid, timeout=600), model=h.model))
    return plans, kvs


def _measure(h, args) -> tuple[list[dict], list]:
    """Both load modes, interleaved ``reps`` times after one warm-up request per mode: the rows
    of :func:`run_mode`, and the composed plans."""
    from kvtransport.transfer.blocks import encode_block
    from kvtransport.transfer.grpc_transport import GrpcTransport

    staging = GrpcTransport()                      # the prefill executor's pushes land here first
    try:
        plans, kvs = _composed_prefixes(h, args, staging, staging.serve("127.0.0.1", 0))

        def fresh(i: int):                                 # a new transfer id per push, same KV
            return encode_block(uuid.uuid4().hex, h.model, kvs[i])

        for mode in MODES:                                 # warm-up: one composed request per mode, alone
            b = fresh(args.arrivals)
            h.prefill.transport.blocks.send(h.vllm.address, b, timeout=600)
            prefix = tuple(t for s in plans[-1].steps for t in s.token_ids)
            list(h.vllm.generate(b.header.transfer_id, prefix, plans[-1].suffix_ids, SamplingParams(max_tokens=2),
                                 salt=f"warm-{mode}-{uuid.uuid4().hex}", kv_load=mode))
        rows = []
        order = [m for r in range(args.reps) for m in (MODES if r % 2 == 0 else MODES[::-1])]
        for mode in progress(order, "load modes x reps"):
            rows.append(run_mode(h, mode, args, plans[:args.arrivals], [fresh(i) for i in range(args.arrivals)]))
    finally:
        staging.stop()
    return rows, plans


def _summary(args, rows: list[dict]) -> dict:
    """The run's JSON: its args, every row, medians per mode and the async/sync ratios."""
    med = {m: {k: statistics.median(v for r in rows if r["mode"] == m
                                    for v in (r[k] if isinstance(r[k], list) else [r[k]]))
               for k in ("quiet_tok_s", "arrivals_tok_s", "quiet_max_gap_s", "arrivals_max_gap_s", "compose_ttft_s",
                         "push_s")} for m in MODES}
    s, a = med["sync"], med["async"]
    return {"args": vars(args), "platform": platform.platform(), "cpus": os.cpu_count(), "rows": rows,
            "medians": med,
            "ratios": {"streams' tok/s during arrivals, async/sync": a["arrivals_tok_s"] / max(s["arrivals_tok_s"], 1e-9),
                       "streams' max gap during arrivals, sync/async":
                           s["arrivals_max_gap_s"] / max(a["arrivals_max_gap_s"], 1e-9),
                       "composed TTFT (push to first token), async/sync": a["compose_ttft_s"] / s["compose_ttft_s"]}}


def _print_table(args, out: dict, prompt_tokens: int) -> None:
    rows, med = out["rows"], out["medians"]
    print(f"\n{args.streams} streams of {args.stream_context} tokens decoding; {args.arrivals} composed "
          f"requests of ~{prompt_tokens} tokens arriving {args.spacing_s:g} s apart ({args.model}, "
          f"{args.dtype}, {args.threads} thread(s)); medians of {args.reps} interleaved rep(s)\n")
    print("| load | streams alone tok/s | during arrivals tok/s | kept | max gap alone s | max gap during "
          "arrivals s | composed TTFT p50 s (push s) | fallbacks |")
    print("|---|---|---|---|---|---|---|---|")
    for m in MODES:
        r = med[m]
        print(f"| {m} | {r['quiet_tok_s']:.1f} | {r['arrivals_tok_s']:.1f} | "
              f"{r['arrivals_tok_s'] / max(r['quiet_tok_s'], 1e-9):.0%} | {r['quiet_max_gap_s']:.2f} | "
              f"{r['arrivals_max_gap_s']:.2f} | {r['compose_ttft_s']:.2f} ({r['push_s']:.2f}) | "
              f"{sum(len(f) for x in rows if x['mode'] == m for f in x['fallbacks'])} |")
    print()
    for k, v in out["ratios"].items():
        print(f"- {k}: {v:.2f}x")


def main() -> None:
    """Parse, build the composed prefixes, measure both modes, write the JSON, print the table."""
    args = _args()
    from bench.vllm_side_by_side import Harness

    h = Harness(args.model, args.dtype, args.threads)
    h.max_stream_tokens = 8192 - args.stream_context - 64
    try:
        rows, plans = _measure(h, args)
    finally:
        h.close()
    out = _summary(args, rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    _print_table(args, out, plans[0].prompt_tokens)


if __name__ == "__main__":
    main()
