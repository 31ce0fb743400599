"""Load-aware routing under concurrent load: throughput and the per-actor split (CPU seconds of
each prefill and decode actor, read from the PIDs /health reports) for several actor layouts,
each on a fresh embedded cluster, the same workload side by side: OpenAI chat requests sharing one
long system prompt (the case that made one prefill actor hot under hash affinity).

    python -m bench.load_split --layouts 1+1 2+2 2+1 --requests 16 --concurrency 4

By default each layout gets its own lm:// tier server (kvtransport.tier.server), shared by its
prefill actors, as in deploy/kvnotes.yaml; ``--no-remote-tier`` measures local tiers only.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import time
from bench.progress import progress as _progress


def _cpu(pid: int) -> float:
    import psutil
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def run_layout(n_prefill: int, n_decode: int, requests: int, concurrency: int, max_tokens: int,
               local_cpus: int, remote_tier: bool) -> dict:
    import tempfile

    from cluster.control.ray_backends import tier_key_of
    from kvruntime.config import ClusterConfig, WorkerConfig
    from kvtransport.tier.server import free_port, start_tier_server, stop_tier_server

    tier_port = free_port()
    cfg = ClusterConfig.of(port=free_port(), tier_cpu_bytes=96 << 20, data_dir=tempfile.mkdtemp(prefix="kvnotes-bench-"),
                        prefill=WorkerConfig(count=n_prefill), decode=WorkerConfig(count=n_decode),
                        tier_remote_url=f"lm://127.0.0.1:{tier_port}" if remote_tier else None)
    # the layout's own lm:// tier server, its key derived from this cluster's secret like the actors'
    tier = start_tier_server("127.0.0.1", tier_port, key=tier_key_of(cfg)) if remote_tier else None
    try:
        return _measure(cfg, requests, concurrency, max_tokens, local_cpus)
    finally:
        if tier is not None:
            stop_tier_server(tier)


def _measure(cfg, requests: int, concurrency: int, max_tokens: int, local_cpus: int) -> dict:
    import httpx

    from cluster.operator.launcher import start, stop

    system = " ".join(f"Rule {i}: answer politely and briefly, cite the policy section number." for i in range(80))
    import ray
    # a fresh local Ray of its own (never a `ray start` cluster found on the machine)
    ray.init(address="local", num_cpus=local_cpus, namespace="kvnotes", include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"LMCACHE_TRACK_USAGE": "false", "PYTHONHASHSEED": "0"}})
    start(cfg, local_cpus=local_cpus)
    try:
        key = cfg.state.api_key_file.read_text().strip()        # the key the embedded default created
        http = httpx.Client(base_url=f"http://127.0.0.1:{cfg.server.port}", timeout=600,
                            headers={"authorization": f"Bearer {key}"})
        for _ in range(240):
            try:
                if http.get("/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)

        def chat(i: int) -> int:
            r = http.post("/v1/chat/completions", json={
                "model": cfg.workers.model, "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}?"}]})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        chat(-1)                                             # the shared prefix lands in the tier
        snap = http.get("/health").json()["workers"]
        pids = {w["name"]: w["pid"] for role in ("prefill", "decode") for w in snap[role]["workers"]}
        before = {n: _cpu(p) for n, p in pids.items()}
        t = time.perf_counter()
        with cf.ThreadPoolExecutor(concurrency) as ex:
            tokens = sum(ex.map(chat, range(requests)))
        wall = time.perf_counter() - t
        cpu = {n: round(_cpu(p) - before[n], 2) for n, p in pids.items()}
    finally:
        stop(cfg)
    return {"layout": f"{cfg.workers.prefill.count}+{cfg.workers.decode.count}", "requests": requests,
            "seconds": round(wall, 2),
            "req_per_s": round(requests / wall, 3), "completion_tokens": tokens, "cpu_s": cpu}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=["1+1", "2+2", "2+1"])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--local-cpus", type=int, default=5, help="logical CPUs of the embedded Ray")
    ap.add_argument("--no-remote-tier", action="store_true",
                    help="no shared lm:// tier: each prefill actor recomputes the shared prefix once")
    a = ap.parse_args(argv)
    rows = []
    for lay in _progress(a.layouts, "layouts"):
        p, d = (int(x) for x in lay.split("+"))
        rows.append(run_layout(p, d, a.requests, a.concurrency, a.max_tokens, a.local_cpus, not a.no_remote_tier))
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["req_per_s"]
    print("\n| layout | req/s | vs first | CPU s per actor |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['req_per_s']} | {r['req_per_s'] / base:.2f}x | "
              f"{', '.join(f'{k} {v}' for k, v in r['cpu_s'].items())} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
