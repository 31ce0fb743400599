"""The control path of a composed request (HTTP, Serve, validation, rendering, tier lookups,
planning, Ray calls) at ~1k/4k/8k tokens, per stage, from the router's own records.

    python -m bench.control_path [--sizes 1024 4096 8192] [--reps 5] [--json runs/control_path.json]
    python -m bench.control_path --from-json runs/control_path.json       # the tables of a saved run
    python -m bench.control_path --matching [--tokens 8192 --fingerprints 10000]   # prompt matching's cost

Starts the cluster in this process (``cluster.operator.launcher.start``: the reference decode engine, 1
prefill and 1 decode actor, shadow checks off, a throwaway data directory and API key) and stops it by
Ray shutdown on exit, Ctrl-C or error. Per size it registers ~1k-token skills and sends composed
requests (the same skills, order rotated per request, + a new question; ``kv_policy: fast``,
``max_tokens: 1``, streamed, ``explain: true``) over HTTP with the API key. One round of warm-up
requests (every rotation once: every frame variant compiled, every chunk in the tier) is not counted.

Per request, stage seconds come from ``explain.control`` (:class:`cluster.control.context.StageClock`:
consecutive laps in the router replica, ``time.perf_counter`` = CLOCK_MONOTONIC, comparable with this
process's clock on one machine) and ``explain.stages`` (the KV path, measured by the workers):

- ``client -> router``: client send -> the replica's handler starts (HTTP, Serve proxy, Ray handle);
- ``http_auth``, ``admission`` (the queue decision, and the exchange with the other replicas' queues
  while the TTFT objective applies; before the body is read), ``http_body``, ``validate``, ``render`` (tokenise, off the event loop), ``tier_lookup``
  (the Ray call ``contains``), ``lookup_state`` (the rest of that lap: session, pick, ``mark_used``
  state-store writes), ``plan``, ``grant``, ``expect_call`` (Ray call to the decode actor);
- ``prefill Ray overhead``: the ``execute`` call's round trip minus what the prefill actor measured
  (build + send);
- ``decode call overhead``: generate submit -> first token at the router minus the decode actor's
  stages (receive, load, first token): Ray streaming plus actor work outside its stages;
- ``router -> client``: the first token leaves the router -> it reaches this client (SSE, proxy);
- KV path: tier_get, rerotate, forward (prefill), serialise, transfer, receive, load; model forward:
  ``first_token`` (the question's forward and the first sample); ``held_copy`` (the decode engine's
  copy of the prefix for later requests) runs after the first token: shown, counted in no total.

``control total`` = client TTFT minus the KV path and the model forward passes (so it includes the
decode and prefill actors' work outside their measured stages). Medians over the reps, shares of
the median control total.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.cluster_ttft import stream_native

KV_PATH = ("tier_get", "rerotate", "forward", "serialise", "transfer", "receive", "load")
FORWARD = ("first_token",)
AFTER_FIRST = ("held_copy",)      # decode-side stages after the first token: shown, in no total
ROUTER_LAPS = ("http_auth", "admission", "http_body", "validate", "render", "tier_lookup", "lookup_state", "plan", "grant",
               "expect_call")
QUESTIONS = ["Summarise the key facts above in one sentence.", "Which organisation is mentioned first?",
             "List two numbers that appear above.", "What is the main topic of the last section?"]


# ---- pure parts: one request's record -> its stages; records -> table -------------------------
def stages_of(rec: dict) -> dict[str, float]:
    """Seconds per control stage of one recorded request (``rec``: client ``send``/``first`` on
    this process's perf_counter, ``ttft`` and the final event's ``explain``)."""
    ex = rec["explain"]
    ctl, kv = ex.get("control") or {}, ex.get("stages") or {}
    laps = {}
    for k, v in ctl.get("laps", []):
        laps[k] = laps.get(k, 0.0) + v
    work = ctl.get("worker", {})
    out: dict[str, float] = {}
    if ctl.get("start") is not None:
        out["client -> router"] = ctl["start"] - rec["send"]
    for k in ROUTER_LAPS:
        if k == "tier_lookup":
            out[k] = work.get("tier_lookup", 0.0)
        elif k == "lookup_state":
            out[k] = laps.get(k, 0.0) - work.get("tier_lookup", 0.0)
        else:
            out[k] = laps.get(k, 0.0)
    prefilled = "prefill_call" in laps
    actor = work.get("prefill_build", 0.0) + work.get("prefill_send", 0.0)
    if prefilled:
        out["prefill Ray overhead"] = laps["prefill_call"] - actor
    # the decode actor's own stages (its forward: the rest of a prefix it held, when no prefill ran)
    dec = sum(kv.get(k, 0.0) for k in ("receive", "load", "first_token") + (() if prefilled else ("forward",)))
    out["decode call overhead"] = laps.get("decode_call", 0.0) - dec
    if ctl.get("first_token") is not None:
        out["router -> client"] = rec["first"] - ctl["first_token"]
    # the KV path: what the prefill actor measured of its call (build + send), the decode actor's receive/load
    staged = sum(kv.get(k, 0.0) for k in KV_PATH)
    if prefilled:
        decode_side = kv.get("receive", 0.0) + kv.get("load", 0.0)
        out["KV path"] = actor + decode_side
        out["KV path: prefill build outside its stages"] = out["KV path"] - staged
    else:
        out["KV path"] = staged
    out["model forward"] = sum(kv.get(k, 0.0) for k in FORWARD)
    for k in AFTER_FIRST:
        if k in kv:
            out[f"{k} (after the first token)"] = kv[k]
    out["TTFT"] = rec["ttft"]
    out["control total"] = rec["ttft"] - out["KV path"] - out["model forward"]
    return out


def summarise(recs: list[dict]) -> dict[str, float]:
    """Median seconds per stage over ``recs`` (stages missing from a request count as 0)."""
    per = [stages_of(r) for r in recs]
    keys = list(dict.fromkeys(k for p in per for k in p))
    return {k: statistics.median([p.get(k, 0.0) for p in per]) for k in keys}


def markdown(run: dict) -> str:
    """One table per size: median ms per stage and its share of the median control total."""
    out = []
    for size, w in run["sizes"].items():
        med = summarise(w["requests"])
        ctl = med.get("control total", 0.0)
        plans = sorted({r["explain"].get("kind", "?") for r in w["requests"]})
        out.append(f"### {size} tokens ({w['prompt_tokens']} prompt tokens, {len(w['requests'])} requests, "
                   f"plan {', '.join(plans)}; load average {w.get('load', '?')})\n")
        out.append("| stage | median ms | share of control total |")
        out.append("|---|---:|---:|")
        for k, v in med.items():
            if k in ("TTFT", "control total", "KV path", "model forward") or k.startswith("KV path") \
                    or k.endswith("(after the first token)"):
                continue
            out.append(f"| {k} | {v * 1e3:.1f} | {v / ctl:.0%} |" if ctl > 0 else f"| {k} | {v * 1e3:.1f} | - |")
        out.append(f"| **control total** | **{ctl * 1e3:.1f}** | 100% |")
        shown = sum(v for k, v in med.items() if k not in ("TTFT", "control total", "model forward")
                    and not k.startswith("KV path") and not k.endswith("(after the first token)"))
        out.append(f"| (medians' sum: {shown * 1e3:.1f}) | | |")
        out.append(f"| KV path (not control) | {med.get('KV path', 0.0) * 1e3:.1f} | |")
        if "KV path: prefill build outside its stages" in med:
            out.append(f"| of which prefill build outside its stages | "
                       f"{med['KV path: prefill build outside its stages'] * 1e3:.1f} | |")
        out.append(f"| model forward (not control) | {med.get('model forward', 0.0) * 1e3:.1f} | |")
        out.append(f"| TTFT (client) | {med.get('TTFT', 0.0) * 1e3:.1f} | |")
        for k in AFTER_FIRST:
            if f"{k} (after the first token)" in med:
                out.append(f"| {k} (after the first token, in no total) | "
                           f"{med[f'{k} (after the first token)'] * 1e3:.1f} | |")
        out.append("")
    return "\n".join(out)


def header(run: dict) -> str:
    return (f"# control path: {run['model']} {run['dtype']}, reference decode, {run['machine']}, {run['reps']} reps "
            f"per size, run {run.get('seconds', 0):.0f} s" + (f" (INCOMPLETE: {run['incomplete']})"
                                                               if run.get("incomplete") else "")
            + f"\n\n    {run.get('command', 'python -m bench.control_path')}\n")


# ---- the run ------------------------------------------------------------------------------------
def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(client, body: dict) -> dict:
    """One streamed request; client-side perf_counter at send and at the first token, and the
    final event's usage and explain."""
    send, first, fin = stream_native(client, body)
    return {"send": send, "first": first, "ttft": first - send, "prompt": fin["usage"]["prompt_tokens"],
            "cached": fin["usage"]["prompt_tokens_details"]["cached_tokens"], "fallbacks": fin.get("fallbacks", []),
            "explain": fin["explain"]}


def texts(render, n: int, tokens: int) -> list[str]:
    """``n`` passages of about ``tokens`` tokens each (never more), from the shipped passages."""
    from kvruntime.fidelity.cases import load_passages
    words = " ".join(load_passages().values()).split()
    out = []
    for i in range(n):
        k = tokens
        while True:
            t = " ".join(words[(i * 997 + j) % len(words)] for j in range(k))
            got = len(render.encode(t))
            if got <= tokens:
                break
            k = int(k * tokens / got * 0.99)
        out.append(t)
    return out


def measure(client, render, size: int, reps: int, tag: str) -> dict:
    k = max(1, round(size / 1024))
    names = []
    for i, text in enumerate(texts(render, k, int(size * 0.96 / k))):
        name = f"{tag}-{size}-{i}"
        r = client.post("/v1/skills", json={"name": name, "text": text})
        if r.status_code != 201:
            raise RuntimeError(f"registering {name}: HTTP {r.status_code} {r.text[:200]}")
        names.append(name)

    def one(rep: int) -> dict:
        order = [(rep + j) % k for j in range(k)]
        q = f"{QUESTIONS[rep % len(QUESTIONS)]} (ref {uuid.uuid4().hex[:6]})"
        return request(client, {"segments": [{"skill": names[j]} for j in order] + [{"text": q}], "kv_policy": "fast",
                                "max_tokens": 1, "temperature": 0, "explain": True})
    for rep in range(k):                      # warm-up: every rotation once (frame variants, tier)
        one(rep)
    recs = [one(rep) for rep in range(reps)]
    return {"requests": recs, "prompt_tokens": recs[0]["prompt"], "load": "%.2f %.2f %.2f" % os.getloadavg()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.control_path")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--sizes", type=int, nargs="*", default=[1024, 4096, 8192])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="", help="save the records here (JSON)")
    ap.add_argument("--from-json", metavar="FILE", help="print the tables of a saved run; start nothing")
    ap.add_argument("--matching", action="store_true",
                    help="only the prompt-matching row (bench.prompt_matching, in process): start nothing")
    args, rest = ap.parse_known_args(argv)
    if args.matching:
        from bench import prompt_matching
        return prompt_matching.main(rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.from_json:
        run = json.loads(Path(args.from_json).read_text())
        print(header(run) + "\n" + markdown(run))
        return 0
    if not args.sizes or any(not 256 <= s <= 8192 for s in args.sizes) or args.reps < 1:
        ap.error("sizes in 256..8192 and --reps >= 1 required")
    import httpx
    import transformers
    from cluster.control.render import Renderer
    from cluster.operator.launcher import start, stop
    from kvruntime.checkpoint import ensure_checkpoint
    from kvruntime.config import ClusterConfig
    from kvruntime.models import get_model_spec
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    spec = get_model_spec(args.model)
    tok = transformers.AutoTokenizer.from_pretrained(ensure_checkpoint(spec))
    render = Renderer(tok, spec, None, tok.bos_token_id)
    workdir = Path(tempfile.mkdtemp(prefix="kvnotes-ctl-"))
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    t0 = time.perf_counter()
    run = {"model": args.model, "dtype": args.dtype, "reps": args.reps, "sizes": {},
           "machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "command": "python -m bench.control_path " + " ".join(argv if argv is not None else sys.argv[1:])}
    cfg = ClusterConfig.of(port=_port(), model=args.model, dtype=args.dtype, shadow_fraction=0.0,
                        tier_cpu_bytes=2 << 30, data_dir=str(workdir / "state"))
    tag = uuid.uuid4().hex[:6]
    try:
        with contextlib.redirect_stdout(sys.stderr):      # the throwaway key's banner: not into the table
            start(cfg, local_cpus=4)
        key = cfg.state.api_key_file.read_text().strip()
        with httpx.Client(base_url=f"http://127.0.0.1:{cfg.server.port}", timeout=900,
                          headers={"authorization": f"Bearer {key}"}) as client:
            for _ in range(600):
                with contextlib.suppress(httpx.HTTPError):
                    if client.get("/health").status_code == 200:
                        break
                time.sleep(1)
            for size in args.sizes:
                print(f"size {size}...", file=sys.stderr, flush=True)
                run["sizes"][str(size)] = measure(client, render, size, args.reps, tag)
                if args.json:
                    _save(run, args.json)
    except BaseException as exc:
        run["incomplete"] = f"{type(exc).__name__}: {exc}"[:300]
        raise
    finally:
        stop(cfg)
        shutil.rmtree(workdir, ignore_errors=True)
        run["seconds"] = time.perf_counter() - t0
        if args.json:
            _save(run, args.json)
        if run["sizes"]:
            print(header(run) + "\n" + markdown(run))
    return 0


def _save(run: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(run, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
