"""Drive a running kvnotes cluster over HTTP: client-side TTFT p50/p90 per plan kind at 1k/4k-token
contexts next to recompute (``kv_policy: exact``) in the same run, and a field-edit session
workload (one field changes per turn over 20 turns) reporting prefix hit rate.

    kvnotes run &                                   # or kvnotes serve --config ...
    python -m bench.cluster_ttft --url http://127.0.0.1:8000   # key: --api-key, $KVNOTES_API_KEY or ~/.local/share/kvnotes/api_key
    python -m bench.cluster_ttft --start            # start an embedded cluster in this process
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid

import httpx
from bench.progress import progress as _progress


def stream_native(client: httpx.Client, body: dict) -> tuple[float, float, dict]:
    """One streamed native request: (perf_counter at send, perf_counter at the first token, the
    final event). RuntimeError on an HTTP error or an in-band error event."""
    send = time.perf_counter()
    first, final = None, {}
    with client.stream("POST", "/v1/notes/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(ev["error"]["message"])
            if "token" in ev and first is None:
                first = time.perf_counter()
            if "usage" in ev:
                final = ev
    return send, (first if first is not None else time.perf_counter()), final


def _ttft(client: httpx.Client, body: dict) -> tuple[float, dict]:
    """Client-side seconds to the first streamed token, and the final event."""
    send, first, final = stream_native(client, body)
    return first - send, final


def _pct(xs, q):
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def _passages(n_tokens_each: int, count: int) -> list[str]:
    from kvruntime.fidelity.cases import load_passages
    texts = list(load_passages().values())
    words = " ".join(texts).split()
    per = int(n_tokens_each / 1.35)               # ~1.35 SmolLM2 tokens per English word
    return [" ".join(words[i * per:(i + 1) * per]) for i in range(count)]


def compose(client: httpx.Client, size: int, reps: int) -> list[str]:
    n_chunks = max(2, size // 512)
    chunks = _passages(int(size * 0.92 / n_chunks), n_chunks)
    names = []
    for i, text in enumerate(chunks):
        name = f"bench-{size}-{i}"
        r = client.post("/v1/skills", json={"name": name, "text": text})
        if r.status_code != 201:
            raise RuntimeError(f"registering {name}: HTTP {r.status_code} {r.text[:200]}")
        names.append(name)
    rows, base = [], None
    for policy, label in (("exact", "recompute"), ("fast", "reposition")):   # balanced follows the profile: not a fixed op
        ts, prompt, cached = [], 0, 0
        for k in range(reps):
            segs = [{"skill": n} for n in names] + [{"text": f"Question {uuid.uuid4().hex[:6]}: summarise part {k}."}]
            t, fin = _ttft(client, {"segments": segs, "max_tokens": 4, "temperature": 0, "kv_policy": policy})
            ts.append(t)
            prompt, cached = fin["usage"]["prompt_tokens"], fin["usage"]["prompt_tokens_details"]["cached_tokens"]
        p50, p90 = statistics.median(ts), _pct(ts, 90)
        base = base or (p50, p90)
        rows.append(f"| compose {size} | {label} | {prompt} | {cached / prompt:.0%} | {p50:.2f} | {p90:.2f} | "
                    f"{base[0] / p50:.1f}x | {base[1] / p90:.1f}x |")
    return rows


def edit_session(client: httpx.Client, turns: int, doc_tokens: int) -> list[str]:
    filler = _passages(doc_tokens, 1)[0]
    tname = f"bench-booking-{uuid.uuid4().hex[:6]}"
    text = "Booking record. Current order status: {status}. Notes follow.\n" + filler.replace("{", "(").replace("}", ")")
    r = client.post("/v1/templates", json={"name": tname, "text": text, "labels": {"status": "order status"}})
    if r.status_code != 201:
        raise RuntimeError(f"registering template: HTTP {r.status_code} {r.text[:200]}")
    statuses = ["PENDING", "SHIPPED", "DELAYED", "DELIVERED", "RETURNED"]
    rows, base = [], None
    for policy, strategy, label in (("exact", "auto", "policy exact"), ("fast", "auto", "fast, planner's choice"),
                                    ("fast", "erratum", "fast, erratum forced")):
        session = f"bench-{policy}-{strategy}-{uuid.uuid4().hex[:6]}"
        ts, prompt, cached, kinds = [], 0, 0, {}
        for turn in range(turns):
            body = {"session": session, "kv_policy": policy, "max_tokens": 4, "temperature": 0, "edit_strategy": strategy,
                    "segments": [{"template": tname, "fields": {"status": statuses[turn % len(statuses)]}},
                                 {"text": "What is the order status now? One word."}]}
            t, fin = _ttft(client, body)
            if turn:                                  # turn 0 fills the cache for both policies
                ts.append(t)
                prompt += fin["usage"]["prompt_tokens"]
                cached += fin["usage"]["prompt_tokens_details"]["cached_tokens"]
                kinds[fin["plan"]] = kinds.get(fin["plan"], 0) + 1
        p50, p90 = statistics.median(ts), _pct(ts, 90)
        base = base or (p50, p90)
        rows.append(f"| field edit x{turns - 1} | {label} {kinds} | {prompt // (turns - 1)} | {cached / prompt:.0%} | "
                    f"{p50:.2f} | {p90:.2f} | {base[0] / p50:.1f}x | {base[1] / p90:.1f}x |")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cluster_ttft")
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=os.environ.get("KVNOTES_API_KEY"),
                    help="Bearer key (default: $KVNOTES_API_KEY, else the embedded default's key file)")
    ap.add_argument("--start", action="store_true", help="start an embedded cluster on a free port first")
    ap.add_argument("--sizes", type=int, nargs="*", default=[1024, 4096], help="compose sizes (none: skip)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--turns", type=int, default=21, help="session turns (the first only fills the cache)")
    ap.add_argument("--doc-tokens", type=int, default=1000)
    args = ap.parse_args(argv)
    cfg = None
    if args.start:
        import socket
        from kvruntime.config import ClusterConfig
        from cluster.operator.launcher import start
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cfg = ClusterConfig.of(port=port)
        start(cfg)
        args.url = f"http://127.0.0.1:{port}"
    key = args.api_key
    if key is None:
        from kvruntime.config import ClusterConfig
        f = (cfg or ClusterConfig()).state.api_key_file
        key = f.read_text().strip() if f.exists() else None
    client = httpx.Client(base_url=args.url, timeout=600,
                          headers={"authorization": f"Bearer {key}"} if key else {})
    try:
        if client.get("/health").status_code != 200:
            raise SystemExit(f"no kvnotes router at {args.url}")
        print(f"# cluster TTFT ({args.url}), client-side time to first streamed token, {args.reps} requests each")
        print("| workload | plan | prompt tokens | cached | TTFT p50 (s) | TTFT p90 (s) | p50 speed-up | p90 speed-up |")
        print("|---|---|---|---|---|---|---|---|")
        for size in _progress(args.sizes, "context sizes"):
            for row in compose(client, size, args.reps):
                print(row, flush=True)
        for row in edit_session(client, args.turns, args.doc_tokens):
            print(row, flush=True)
    finally:
        client.close()
        if cfg is not None:
            from cluster.operator.launcher import stop
            stop(cfg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
