"""Agent and RAG traffic through the official ``openai`` client: kvnotes (vLLM decode engine) vs plain
vLLM with prefix caching on, in one run, per policy.

    python -m bench.agent_traffic [--turns 4] [--policies exact balanced fast] [--json runs/agent_traffic.json]
    python -m bench.agent_traffic --from-json runs/agent_traffic.json      # the tables of a saved run

Starts plain vLLM's OpenAI server and the kvnotes cluster with ``bench.cluster_vs_vllm.Systems``
(same converted SmolLM2 checkpoint and dtype, the same KV space each, prefix caching on, shadow
checks off). The traffic (``bench.agent_traffic_shapes``): 3 of 8 documents reordered, a record
whose status line changes, one tool catalogue after 4 personas, a growing tool-using
conversation, RAG over reranked passages, multi-agent hand-offs sharing a catalogue, tool outputs
re-sent after a changing summary. Every request is a streamed chat completion (greedy,
``max_tokens`` 16), sent to both systems one after the other (which goes first alternates), the
shapes interleaved turn by turn. Each policy runs fresh on both: a new kvnotes tenant (its own
key, prompt index, fingerprints and tier salt) and a new ``cache_salt`` on plain vLLM.

Reported per (policy, shape): the share of prompt tokens reused (kvnotes by kind from
``usage.prompt_tokens_details``: exact / composed / edited; vLLM: ``cached_tokens``), client-side
TTFT p50/p90 (request sent -> first content delta), outputs equal to the reference (``exact``:
plain vLLM's greedy tokens, which are a recompute's; ``balanced``/``fast``: kvnotes ``exact``'s),
the plans and the stage medians from ``explain`` (worker stages and ``control.*`` router laps).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

from bench.agent_traffic_shapes import SHAPES, Sizes, markdown, requests, stage_table, summarize
from bench.cluster_vs_vllm import Systems

POLICIES = ("exact", "balanced", "fast")


def chat_stream(client, model: str, messages: list[dict], n: int, extra: dict) -> dict:
    """One streamed greedy chat completion: TTFT (to the first content delta), the text, usage."""
    t = time.perf_counter()
    first, parts, usage, info = None, [], {}, {}
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=n, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=extra)
    for chunk in stream:
        d = chunk.to_dict()
        for c in d.get("choices") or ():
            piece = (c.get("delta") or {}).get("content")
            if piece:
                first = first if first is not None else time.perf_counter() - t
                parts.append(piece)
        usage = d.get("usage") or usage
        info = d.get("kvnotes") or info
    details = usage.get("prompt_tokens_details") or {}
    ex = info.get("explain", {})
    stages = {**ex.get("stages", {}), **{f"control.{k}": v for k, v in ex.get("control", {}).get("laps", [])}}
    return {"ttft": first if first is not None else time.perf_counter() - t, "text": "".join(parts),
            "prompt": usage.get("prompt_tokens", 0), "cached": details.get("cached_tokens") or 0,
            "exact": details.get("exact_tokens", details.get("cached_tokens") or 0),
            "composed": details.get("composed_tokens", 0), "edited": details.get("edited_tokens", 0),
            "plan": info.get("plan", ""), "fallbacks": info.get("fallbacks", []), "stages": stages,
            "notes": ex.get("notes", [])}


class Clients:
    """The two OpenAI clients of one policy: a fresh kvnotes tenant, a fresh vLLM cache salt."""

    def __init__(self, s: Systems, policy: str, tag: str):
        import openai
        from cluster.control.state import open_state
        from cluster.http.auth import create_key

        store = open_state(s.cfg.state.resolved_url)
        try:
            key, _ = create_key(store, f"agent-{policy}-{tag}")
        finally:
            store.close()
        self.kv = openai.OpenAI(base_url=f"http://127.0.0.1:{s.cfg.server.port}/v1", api_key=key, timeout=900)
        self.vllm = openai.OpenAI(base_url=str(s.vllm.base_url).rstrip("/") + "/v1", api_key="none", timeout=900)
        self.policy, self.salt = policy, f"agent-{policy}-{tag}-{uuid.uuid4().hex}"

    def both(self, model: str, messages: list[dict], n: int, kv_first: bool) -> tuple[dict, dict]:
        calls = [("kvnotes", lambda: chat_stream(self.kv, model, messages, n,
                                                 {"kv_policy": self.policy, "explain": True})),
                 ("vllm", lambda: chat_stream(self.vllm, model, messages, n, {"cache_salt": self.salt}))]
        got = dict((name, f()) for name, f in (calls if kv_first else calls[::-1]))
        return got["kvnotes"], got["vllm"]


def run_policy(s: Systems, policy: str, traffic: dict[str, list], n: int, tag: str, sink=None) -> list[dict]:
    """``sink(records so far)`` after every request pair (a run cut short keeps them)."""
    c = Clients(s, policy, tag)
    recs, k = [], 0
    turns = max(len(v) for v in traffic.values())
    for turn in range(turns):
        for shape, reqs in traffic.items():          # shapes interleaved turn by turn
            if turn >= len(reqs):
                continue
            kv, vl = c.both(s.model, reqs[turn], n, kv_first=k % 2 == 0)
            k += 1
            for system, r in (("kvnotes", kv), ("vllm", vl)):
                recs.append({**r, "policy": policy, "shape": shape, "turn": turn, "system": system,
                             "request": f"{shape}-{turn}"})
            if sink is not None:
                sink(recs)
            if kv["fallbacks"]:
                print(f"kvnotes {shape} turn {turn} fell back: {kv['fallbacks']}", file=sys.stderr, flush=True)
            print(f"  {policy} {shape} turn {turn}: {kv['prompt']} tokens, kvnotes {kv['ttft']:.2f} s "
                  f"(reused {kv['cached']} = {kv['exact']} exact + {kv['composed']} composed + {kv['edited']} edited, "
                  f"{kv['plan']}{_waits(kv['stages'])}), vLLM {vl['ttft']:.2f} s (reused {vl['cached']})",
                  file=sys.stderr, flush=True)
    return recs


def _waits(stages: dict) -> str:
    """The prefill call beside the forward it ran: the difference is mostly the prefill worker's
    queue (background compiles and store-behinds ahead of the request)."""
    call = stages.get("control.prefill_call")
    return "" if call is None else f"; prefill call {call:.2f} s, forward {stages.get('forward', 0.0):.2f} s"


def _print(r: dict) -> None:
    rows = summarize(r["records"])
    print(f"# agent traffic: kvnotes (vLLM decode) vs plain vLLM (prefix caching): {r['model']} {r['dtype']}, "
          f"vLLM {r.get('vllm')}, {r['machine']}, max_tokens {r['max_tokens']}, {r['turns']} turns per shape, "
          f"run {r.get('seconds', 0):.0f} s" + (f" (INCOMPLETE: {r['incomplete']})" if r.get("incomplete") else "") + "\n")
    print(markdown(rows))
    print()
    print(stage_table(rows))


def _args(argv):
    ap = argparse.ArgumentParser(prog="python -m bench.agent_traffic")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--policies", nargs="*", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--turns", type=int, default=4, help="requests per shape per policy")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--doc-tokens", type=int, default=Sizes.doc_tokens)
    ap.add_argument("--record-tokens", type=int, default=Sizes.record_tokens)
    ap.add_argument("--tools", type=int, default=Sizes.tools)
    ap.add_argument("--tool-output-tokens", type=int, default=Sizes.tool_output_tokens)
    ap.add_argument("--rag-tokens", type=int, default=Sizes.rag_tokens)
    ap.add_argument("--kv-gib", type=int, default=1, help="vLLM KV space (GiB), each of the two engines")
    ap.add_argument("--tier-gib", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="runs/agent_traffic.json")
    ap.add_argument("--from-json", metavar="FILE", help="print the tables of a saved run; start nothing")
    ap.add_argument("--attach", nargs=3, metavar=("KVNOTES_URL", "VLLM_URL", "STATE_URL"),
                    help="measure systems already running (e.g. another run's, while it is paused): "
                         "start and stop nothing; the policies' tenants are created in STATE_URL")
    args = ap.parse_args(argv)
    if args.turns < 1 or args.max_tokens < 1 or not args.policies or not args.shapes:
        ap.error("--turns >= 1, --max-tokens >= 1 and at least one policy and shape required")
    if "exact" in args.policies:                      # the reference of the other policies runs first
        args.policies = ["exact"] + [p for p in args.policies if p != "exact"]
    return args


def _attach(s: Systems, kv_url: str, vllm_url: str, state_url: str) -> None:
    """Point ``s`` at running systems (``start``/``close`` are then not called)."""
    import httpx
    from urllib.parse import urlsplit
    s.cfg = SimpleNamespace(server=SimpleNamespace(port=urlsplit(kv_url).port), state=SimpleNamespace(resolved_url=state_url))
    s.vllm = httpx.Client(base_url=vllm_url, timeout=900)


def main(argv=None) -> int:
    args = _args(argv)
    if args.from_json:
        _print(json.loads(Path(args.from_json).read_text()))
        return 0
    if args.attach:
        return _run_attached(args)
    sizes = Sizes(args.doc_tokens, args.record_tokens, args.tools, args.tool_output_tokens, args.rag_tokens)
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    workdir = Path(tempfile.mkdtemp(prefix="kvnotes-agent-"))
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    tag, t0 = uuid.uuid4().hex[:6], time.perf_counter()
    r = {"model": args.model, "dtype": args.dtype, "max_tokens": args.max_tokens, "turns": args.turns,
         "machine": f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} at start",
         "sizes": sizes.__dict__, "records": []}
    s = Systems(args.model, args.dtype, args.kv_gib, args.tier_gib, workdir)
    try:
        traffic = requests(s.text, args.shapes, args.turns, args.seed, sizes)
        print("starting plain vLLM (OpenAI server) and the kvnotes cluster (vLLM decode)...", file=sys.stderr, flush=True)
        s.start()
        r["vllm"], r["startup_s"] = __import__("vllm").__version__, time.perf_counter() - t0
        warm = Clients(s, "exact", f"{tag}-warm")        # one-off costs (kernels, connections), not counted
        warm.both(s.model, [{"role": "user", "content": "Say hello."}], 2, True)
        for policy in args.policies:                     # a run cut short keeps what it measured
            r["records"] += run_policy(s, policy, traffic, args.max_tokens, tag,
                                       sink=lambda recs: _save({**r, "records": r["records"] + recs}, args.json))
            r.setdefault("counters", {})[policy] = _counters(s.cfg.server.port)
            _save(r, args.json)
    except BaseException as exc:                         # Ctrl-C, SIGTERM, an error: save, report, stop
        r["incomplete"] = f"{type(exc).__name__}: {exc}"[:300]
        saved = Path(args.json)
        if saved.exists():                               # the policy under way's records, as its sink left them
            r["records"] = json.loads(saved.read_text()).get("records", r["records"])
        raise
    finally:
        s.close()
        shutil.rmtree(workdir, ignore_errors=True)
        r["seconds"] = time.perf_counter() - t0
        _save(r, args.json)
        if r["records"]:
            _print(r)
    return 0


def _run_attached(args) -> int:
    sizes = Sizes(args.doc_tokens, args.record_tokens, args.tools, args.tool_output_tokens, args.rag_tokens)
    t0, tag = time.perf_counter(), uuid.uuid4().hex[:6]
    r = {"model": args.model, "dtype": args.dtype, "max_tokens": args.max_tokens, "turns": args.turns,
         "machine": f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} at start (attached)",
         "sizes": sizes.__dict__, "records": [], "vllm": __import__("vllm").__version__}
    s = Systems(args.model, args.dtype, args.kv_gib, args.tier_gib, Path(tempfile.gettempdir()))
    _attach(s, *args.attach)
    traffic = requests(s.text, args.shapes, args.turns, args.seed, sizes)
    try:
        for policy in args.policies:
            r["records"] += run_policy(s, policy, traffic, args.max_tokens, tag,
                                       sink=lambda recs: _save({**r, "records": r["records"] + recs}, args.json))
            _save(r, args.json)
    finally:
        r["seconds"] = time.perf_counter() - t0
        _save(r, args.json)
        if r["records"]:
            _print(r)
    return 0


COUNTERS = ("kvnotes_recurring_spans_total", "kvnotes_prompt_stores_total", "kvnotes_reuse_miss_total",
            "kvnotes_reused_tokens_total", "kvnotes_fallbacks_total")


def _counters(port: int) -> dict[str, float]:
    """The router's matching / store-behind / reuse counters so far (all tenants: cumulative over
    the policies run before), from its /metrics; {} when it does not answer."""
    import urllib.request
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith(COUNTERS) and not name.startswith("#"):
            try:
                if float(value):
                    out[name] = float(value)
            except ValueError:
                pass
    return out


def _save(r: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
