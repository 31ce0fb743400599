"""The seed paper's online benchmark: field-edit sessions under Poisson arrivals, through the real
kvnotes cluster (vLLM decode) against plain vLLM with automatic prefix caching, same checkpoint.

    python -m bench.online_edit [--sizes 1024 4096] [--requests 96] [--factors 0.25 0.5 1 2 4]
                                [--json runs/online_edit.json] [--plots docs/img]
    python -m bench.online_edit --from-json runs/online_edit.json      # tables of a saved run

Workload (arXiv 2606.17107, section 6): ``--sessions`` sessions, each over its own record of about
``size`` tokens (a registered template) whose early field (the order status) changes every turn,
then a question. Requests arrive as a Poisson process at each offered rate; each arrival is the next
turn of the next session (round robin), and a session's turns run in order (a turn that arrives
while its previous one is still running waits, and that wait counts in its TTFT). Three systems,
one after another, on the same arrival times (the whole machine for each):

* ``kvnotes erratum``: the cluster's session API, ``edit_strategy: erratum`` (the old context is
  reused whole, a correction appended before the question);
* ``kvnotes edit-in-place``: ``edit_strategy: edit_in_place`` (the field and its top-K tokens
  recomputed in place);
* ``vLLM APC``: plain vLLM re-sending the edited prompt (same token ids, one ``cache_salt`` per
  session, so its prefix cache holds everything before the field).

Each session's first turn is sent before the clock starts (it fills both systems' caches); the
measured turns all change the field. Reported per system and rate: prefix-cache hit rate (prompt
tokens nobody computed for the request, from ``usage.prompt_tokens_details.cached_tokens``),
p50/p90 TTFT (client side, from the scheduled arrival to the first streamed token) and achieved
throughput (completed requests / seconds from the first arrival to the last completion). Rates
are ``--factors`` times plain vLLM's capacity, measured first as 1 / its median TTFT of a
sequential edited turn at that size, unless ``--rates`` gives them in req/s.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from bench.cluster_vs_vllm import Systems
from bench.cluster_vs_vllm_load import EDIT_Q, STATUSES

SYSTEMS = ("kvnotes erratum", "kvnotes edit-in-place", "vLLM APC")


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` in [0, 1] of ``xs`` (nan when empty)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def arrivals(rate: float, count: int, seed: int) -> list[float]:
    """``count`` Poisson arrival offsets (s) at ``rate`` req/s, the first at 0."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def summarise(records: list[dict]) -> dict:
    """Hit rate, TTFT percentiles and achieved throughput of one system at one rate."""
    ok = [r for r in records if "error" not in r]
    prompt = sum(r.get("prompt", 0) for r in ok)
    span = max((r["end"] for r in ok), default=0.0)
    return {"n": len(records), "errors": len(records) - len(ok),
            "hit": (sum(r.get("cached", 0) for r in ok) / prompt) if prompt else 0.0,
            "p50": percentile([r["ttft"] for r in ok], 0.5), "p90": percentile([r["ttft"] for r in ok], 0.9),
            "throughput": len(ok) / span if span > 0 else 0.0}


class Session:
    """One record and its turns on one system; ``turn`` sends the next edit (in order)."""

    def __init__(self, s: Systems, system: str, name: str, text: str, n: int):
        self.s, self.system, self.name, self.text, self.n = s, system, name, text, n
        self.sid, self.salt = f"{name}-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
        self.lock, self.k = threading.Lock(), 0

    def send(self, value: str) -> dict:
        if self.system == "vLLM APC":
            return self.s.vllm_ids(self.s.template_ids(self.text, value) + self.s.question(EDIT_Q), self.salt, self.n)
        strategy = "erratum" if self.system == "kvnotes erratum" else "edit_in_place"
        return self.s.kv_native({"session": self.sid, "kv_policy": "fast", "edit_strategy": strategy,
                                 "segments": [{"template": self.name, "fields": {"status": value}},
                                              {"text": EDIT_Q}]}, self.n)

    def next_value(self) -> str:
        self.k += 1
        return STATUSES[self.k % len(STATUSES)]


def register(s: Systems, size: int, tag: str, i: int) -> tuple[str, str]:
    """A template of about ``size`` tokens, its text distinct per session ``i`` (no shared prefix)."""
    name = f"{tag}-rec{i}-{size}"
    text = (f"Booking record {i}. Current order status: {{status}}. Notes follow.\n"
            + s.text(1000 * i + 3 * size, size - 80))
    r = s.kv.post("/v1/templates", json={"name": name, "text": text, "labels": {"status": "order status"}})
    if r.status_code != 201:
        raise RuntimeError(f"registering template: HTTP {r.status_code} {r.text[:200]}")
    return name, text


def run_rate(s: Systems, system: str, rate: float, count: int, sessions: int, size: int, n: int, seed: int,
             tag: str) -> list[dict]:
    """One system at one offered rate: warm every session, then ``count`` Poisson-timed turns."""
    sess = [Session(s, system, *register(s, size, tag, i), n) for i in range(sessions)]
    for x in sess:                                    # the first turn of each session: fills the caches
        x.send(STATUSES[0])
    times, records, threads = arrivals(rate, count, seed), [None] * count, []
    t0 = time.perf_counter()

    def one(j: int, x: Session, at: float) -> None:
        with x.lock:                                  # a session's turns in order; the wait counts
            value = x.next_value()
            waited = time.perf_counter() - t0 - at     # queued behind the session's previous turn
            try:
                r = x.send(value)
                records[j] = {"at": at, "ttft": waited + r["ttft"], "waited": waited, "prompt": r.get("prompt", 0),
                              "cached": r.get("cached", 0), "plan": r.get("plan", ""),
                              "end": time.perf_counter() - t0}
            except Exception as exc:                  # counted as an error in the table, never dropped
                records[j] = {"at": at, "error": f"{type(exc).__name__}: {exc}"[:200], "end": time.perf_counter() - t0}

    for j, at in enumerate(times):
        delay = at - (time.perf_counter() - t0)
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=one, args=(j, sess[j % sessions], at), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(1800)
    return [r or {"error": "no result (thread still running after 1800 s)", "end": 0.0} for r in records]


def capacity(s: Systems, size: int, n: int, tag: str, turns: int = 3) -> float:
    """Plain vLLM's capacity in req/s for edited turns: 1 / its median sequential TTFT."""
    x = Session(s, "vLLM APC", *register(s, size, f"{tag}-cap", 0), n)
    x.send(STATUSES[0])
    ttfts = [x.send(x.next_value())["ttft"] for _ in range(turns)]
    return 1.0 / percentile(ttfts, 0.5)


def targets(r: dict) -> list[dict]:
    """The online targets per size (what an edit-heavy agent workload needs): kvnotes' hit rate >= 98% on edit turns (every rate), and
    at the highest offered rate p90 TTFT >= 50x lower and throughput >= 5x higher than plain vLLM."""
    out = []
    for size, block in r["sizes"].items():
        if not block["rates"]:
            continue
        top = max(block["rates"], key=lambda row: row["rate"])
        v = top["systems"]["vLLM APC"]
        for name in SYSTEMS[:2]:
            hit = min(row["systems"][name]["hit"] for row in block["rates"])
            m = top["systems"][name]
            p90x = v["p90"] / m["p90"] if m["p90"] > 0 else float("inf")
            thrx = m["throughput"] / v["throughput"] if v["throughput"] > 0 else float("inf")
            out += [{"size": int(size), "system": name, "target": "hit rate >= 98% (lowest over rates)",
                     "value": hit, "pass": hit >= 0.98},
                    {"size": int(size), "system": name, "target": f"p90 TTFT >= 50x lower at {top['rate']:.2f} req/s",
                     "value": p90x, "pass": p90x >= 50},
                    {"size": int(size), "system": name, "target": f"throughput >= 5x at {top['rate']:.2f} req/s",
                     "value": thrx, "pass": thrx >= 5}]
    return out


def markdown(r: dict) -> str:
    ns = {m["n"] for b in r["sizes"].values() for row in b["rates"] for m in row["systems"].values()}
    per_rate = f"{r['requests']} requests per rate" if ns <= {r["requests"]} else "requests per rate as the table says"
    lines = [f"model {r['model']} {r['dtype']}, {per_rate}, {r['sessions']} sessions, "
             f"max_tokens {r['max_tokens']}, {r.get('machine', '')}"]
    for size, block in r["sizes"].items():
        lo, hi = block.get("capacity_range", (block["capacity"], block["capacity"]))
        cap = f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f} (measured per run)"
        lines += ["", f"### ~{size}-token records (plain vLLM capacity {cap} req/s, "
                      f"{block.get('sessions', r['sessions'])} sessions)", "",
                  "| offered req/s | system | requests | hit rate | p50 TTFT s | p90 TTFT s | achieved req/s | errors | "
                  "p90 vs vLLM | throughput vs vLLM |", "|---|---|---|---|---|---|---|---|---|---|"]
        for row in block["rates"]:
            v = row["systems"].get("vLLM APC")
            for name in SYSTEMS:
                m = row["systems"].get(name)
                if m is None:
                    continue
                p90x = ""
                if v and name != "vLLM APC" and m["p90"] > 0:
                    x = v["p90"] / m["p90"]
                    p90x = f"{x:.1f}x lower" if x >= 1 else f"{1 / x:.1f}x higher"
                thrx = f"{m['throughput'] / v['throughput']:.1f}x" if v and name != "vLLM APC" and v["throughput"] else ""
                lines.append(f"| {row['rate']:.2f} | {name} | {m['n']} | {100 * m['hit']:.1f}% | {m['p50']:.2f} | {m['p90']:.2f} "
                             f"| {m['throughput']:.2f} | {m['errors']} | {p90x} | {thrx} |")
    ts = targets(r)
    if ts:
        lines += ["", "| size | system | target | measured | |", "|---|---|---|---|---|"]
        lines += [f"| {x['size']} | {x['system']} | {x['target']} | "
                  + (f"{100 * x['value']:.1f}%" if "hit" in x["target"] else f"{x['value']:.1f}x")
                  + f" | {'met' if x['pass'] else 'missed'} |" for x in ts]
    return "\n".join(lines)


def plot(r: dict, folder: Path) -> list[Path]:
    from bench.plots import _plt
    plt, out = _plt(), []
    for size, block in r["sizes"].items():
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9.5, 3.8), dpi=120)
        xs = [row["rate"] for row in block["rates"]]
        for name, style in zip(SYSTEMS, ("^-", "s-", "o-")):
            a1.plot(xs, [row["systems"][name]["p90"] for row in block["rates"]], style, label=name)
            a2.plot(xs, [row["systems"][name]["throughput"] for row in block["rates"]], style, label=name)
        a1.set_yscale("log")
        a1.set_ylabel("p90 TTFT (s)")
        a2.set_ylabel("achieved req/s")
        for ax in (a1, a2):
            ax.set_xscale("log")
            ax.set_xlabel("offered req/s")
            ax.grid(True, which="both", alpha=0.3)
        a2.legend(fontsize=8)
        fig.suptitle(f"Online field edits, ~{size}-token records, {r['model']} {r['dtype']}")
        fig.tight_layout()
        p = folder / f"online_edit_{size}.png"
        fig.savefig(p)
        plt.close(fig)
        out.append(p)
    return out


def merge(runs: list[dict]) -> dict:
    """Saved runs as one: blocks of the same size get each run's rates (sorted); each block keeps
    its run's session count and command."""
    out = {**runs[0], "sizes": {}, "command": " ; ".join(x.get("command", "") for x in runs)}
    for x in runs:
        for size, block in x["sizes"].items():
            b = out["sizes"].setdefault(size, {"capacity": block["capacity"], "rates": [], "sessions": x["sessions"]})
            b["capacity_range"] = (min(b.get("capacity_range", (block["capacity"],))[0], block["capacity"]),
                                   max(b.get("capacity_range", (0, block["capacity"]))[1], block["capacity"]))
            b["rates"] = sorted(b["rates"] + block["rates"], key=lambda row: row["rate"])
    return out


def _save(r: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(r, indent=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.online_edit")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--sizes", type=int, nargs="*", default=[1024])
    ap.add_argument("--requests", type=int, default=96, help="measured requests per rate and system (paper: 96)")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--factors", type=float, nargs="*", default=[0.25, 0.5, 1.0, 2.0, 4.0],
                    help="offered rates as multiples of plain vLLM's measured capacity")
    ap.add_argument("--rates", type=float, nargs="*", default=[], help="offered rates in req/s (overrides --factors)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kv-gib", type=int, default=1)
    ap.add_argument("--tier-gib", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", default="runs/online_edit.json")
    ap.add_argument("--plots", default="", help="folder for PNGs (e.g. docs/img; '' for none)")
    ap.add_argument("--from-json", metavar="FILE", nargs="+",
                    help="print the tables (and --plots) of saved runs (several: merged by size and rate)")
    args = ap.parse_args(argv)
    if args.from_json:
        r = merge([json.loads(Path(f).read_text()) for f in args.from_json])
        print(markdown(r))
        if args.plots:
            plot(r, Path(args.plots))
        return 0
    if not args.sizes or any(not 256 <= x <= 8000 for x in args.sizes) or args.requests < 1 or args.sessions < 1 \
            or any(f <= 0 for f in args.factors + args.rates) or not (args.factors or args.rates):
        ap.error("sizes in 256..8000, --requests and --sessions >= 1, rates/factors > 0 required")
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    workdir = Path(tempfile.mkdtemp(prefix="kvnotes-online-"))
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    tag, t_start = uuid.uuid4().hex[:6], time.perf_counter()
    r = {"model": args.model, "dtype": args.dtype, "max_tokens": args.max_tokens, "requests": args.requests,
         "sessions": args.sessions, "machine": f"{platform.machine()}, {os.cpu_count()} cores", "sizes": {},
         "command": "python -m bench.online_edit " + " ".join(sys.argv[1:] if argv is None else argv)}
    s = Systems(args.model, args.dtype, args.kv_gib, args.tier_gib, workdir)
    try:
        print("starting plain vLLM and the kvnotes cluster (vLLM decode)...", file=sys.stderr, flush=True)
        s.start()
        for size in args.sizes:
            cap = capacity(s, size, args.max_tokens, tag)
            rates = args.rates or [f * cap for f in args.factors]
            block = r["sizes"][str(size)] = {"capacity": cap, "rates": []}
            for k, rate in enumerate(rates):
                row = {"rate": rate, "systems": {}, "records": {}}
                for name in SYSTEMS:
                    print(f"size {size}: {name} at {rate:.2f} req/s ({args.requests} requests)...",
                          file=sys.stderr, flush=True)
                    recs = run_rate(s, name, rate, args.requests, args.sessions, size, args.max_tokens,
                                    args.seed + k, f"{tag}-{k}-{SYSTEMS.index(name)}")
                    row["records"][name], row["systems"][name] = recs, summarise(recs)
                block["rates"].append(row)
                _save(r, args.json)
    except BaseException as exc:
        r["incomplete"] = f"{type(exc).__name__}: {exc}"[:300]
        raise
    finally:
        s.close()
        shutil.rmtree(workdir, ignore_errors=True)
        r["seconds"] = time.perf_counter() - t_start
        _save(r, args.json)
        if r["sizes"]:
            print(markdown(r))
            if args.plots:
                plot(r, Path(args.plots))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
