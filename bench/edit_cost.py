"""Cost of one field edit in place (``kvruntime.ops.edit.edit_in_place``) vs a full recompute, in
process on the reference engine. Run:
``python -m bench.edit_cost [--sizes 1024 4096 8192] [--top-k 16] [--reps 2] [--model smollm2-135m]``.

Per context size: a ~N-token record whose field (the account owner, near the start) changes to
a value of another length (so the downstream slots are re-rotated too). Compared side by side,
interleaved per repetition: ``edit`` = the product's own ``kvruntime.ops.edit_in_place`` (probe in
query chunks of ``blend.PROBE_CHUNK``, the edited context written into one buffer) and ``full`` =
recomputing the whole edited prompt (what plain vLLM does). Reported: median ms and the peak
resident memory above the pre-call level (sampled every 2 ms). 1 torch thread (the cluster's
prefill actor setting).
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

RECORD = ("Customer record. Account owner: Maria Lopez. Plan: gold. Region: north-east. "
          "Notes follow about deliveries, invoices and support tickets over the last year.\n")
FILLER = ("On {d} the courier delivered order {n} to the warehouse; the invoice of {m} dollars was "
          "paid by the account owner and the support ticket about the late parcel was closed.\n")
NEW_VALUE = " Jonathan Brightwater-Smith"


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class _Peak:
    """Peak RSS above the level at entry, sampled by a thread."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())
        self.mib = (self.peak - self.base) / 2 ** 20


def _context(engine, tokens: int):
    text, i = RECORD, 0
    while len(engine.encode(text)) < tokens:
        text += "".join(FILLER.format(d=f"day {j}", n=1000 + 7 * j, m=40 + 3 * j) for j in range(i, i + 20))
        i += 20
    ids = engine.encode(text)[:tokens]
    head, field = engine.encode("Customer record. Account owner:"), engine.encode(" Maria Lopez")
    if ids[:len(head) + len(field)] != head + field:
        raise SystemExit("the record's field does not tokenize as expected")
    return ids, (len(head), len(head) + len(field))


def _timed(fn):
    with _Peak() as p:
        t = time.perf_counter()
        out = fn()
        ms = (time.perf_counter() - t) * 1e3
    return out, ms, p.mib


def main(argv=None) -> int:
    from kvruntime.engine import ReferenceEngine
    from kvruntime.ops import edit_in_place, recompute
    from kvruntime.ops.blend import PROBE_CHUNK

    ap = argparse.ArgumentParser(prog="python -m bench.edit_cost")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args(argv)
    engine = ReferenceEngine(args.model, dtype="float32", threads=1)
    new_ids = engine.encode(NEW_VALUE)
    print(f"model {args.model} fp32, torch threads {torch.get_num_threads()}, top_k {args.top_k}, "
          f"probe chunk {PROBE_CHUNK}, reps {args.reps} (medians)")
    rows = []
    for n in args.sizes:
        ids, span = _context(engine, n)
        cached = recompute(engine, ids, logits=False).kv
        edited_ids = ids[:span[0]] + new_ids + ids[span[1]:]
        t = {"new": [], "full": []}
        m = {"new": 0.0, "full": 0.0}
        for r in range(args.reps):
            res, ms, mib = _timed(lambda: edit_in_place(engine, cached, span, new_ids, args.top_k))
            t["new"].append(ms)
            m["new"] = max(m["new"], mib)
            del res
            if r == 0:
                _, ms, mib = _timed(lambda: recompute(engine, edited_ids, logits=True))
                t["full"].append(ms)
                m["full"] = mib
        med = {k: statistics.median(v) for k, v in t.items()}
        rows.append((n, med, m))
        print(f"  {n}: edit {med['new']:.0f} ms, full {med['full']:.0f} ms", flush=True)
    print()
    print("| tokens | edit_in_place ms (peak MiB) | full recompute ms (peak MiB) | full/edit |")
    print("|---|---|---|---|")
    for n, med, m in rows:
        print(f"| {n} | {med['new']:.0f} ({m['new']:.0f}) | {med['full']:.0f} ({m['full']:.0f}) | "
              f"{med['full'] / med['new']:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
