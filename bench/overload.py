"""Overload against a running kvnotes cluster: one request shape (a streamed ``/v1/completions``),
its unloaded TTFT and capacity measured first, then ``--multiplier`` x that capacity offered open
loop for ``--seconds``. Reports what was shed (429 / 503, each with its Retry-After and how fast
the refusal came), client timeouts, and the accepted requests' p90 TTFT as a ratio of the unloaded
p90 (issue 35's target: within 2.5x).

    kvnotes run &
    python -m bench.overload --url http://127.0.0.1:8000 --seconds 60 --multiplier 4 --out overload.json
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import gc
import json
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass

import httpx

PROMPT = ("The museum's visitor desk keeps notes on opening hours, ticket prices, guided tours, the cafe, the "
          "cloakroom and accessibility. ")


@dataclass
class Result:
    sent_at: float                 # seconds since the start of the phase
    status: int | None             # None: no response within the client timeout (or a connection error)
    headers_s: float | None        # seconds until the response headers (a refusal's latency)
    ttft_s: float | None           # seconds until the first token (accepted streams)
    retry_after: str | None
    timed_out: bool = False
    error: str = ""


def body_of(prompt_words: int, max_tokens: int) -> dict:
    words = (PROMPT * (prompt_words // len(PROMPT.split()) + 1)).split()[:prompt_words]
    return {"prompt": " ".join(words), "max_tokens": max_tokens, "temperature": 0, "stream": True}


def one(client: httpx.Client, body: dict, timeout_s: float, t0: float) -> Result:
    start = time.perf_counter()
    res = Result(start - t0, None, None, None, None)
    try:
        with client.stream("POST", "/v1/completions", json=body, timeout=timeout_s) as r:
            res.status, res.headers_s = r.status_code, time.perf_counter() - start
            res.retry_after = r.headers.get("retry-after")
            if r.status_code != 200:
                r.read()
                return res
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        res.error = ev["error"].get("message", "")[:200]
                    elif res.ttft_s is None:
                        res.ttft_s = time.perf_counter() - start
    except httpx.TimeoutException:
        res.timed_out = True
    except httpx.TransportError as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    return res


def unloaded(client: httpx.Client, body: dict, n: int, timeout_s: float) -> tuple[list[float], float]:
    """``n`` requests one after another: their TTFTs and the capacity (requests per second)."""
    t0 = time.perf_counter()
    got = [one(client, body, timeout_s, t0) for _ in range(n)]
    bad = [r for r in got if r.status != 200 or r.ttft_s is None or r.error]
    if bad:
        raise RuntimeError(f"unloaded requests failed: {bad[:3]}")
    return [r.ttft_s for r in got], n / (time.perf_counter() - t0)


def offer(client: httpx.Client, body: dict, rate: float, seconds: float, timeout_s: float) -> list[Result]:
    """Open loop: one request every 1/rate seconds for ``seconds``, each on its own thread. The
    caller's heap is frozen meanwhile (``gc.freeze``): a full collection over a large process (a
    test run's: torch, Ray, the suite) would otherwise add its pause to the latencies measured."""
    n = max(1, int(rate * seconds))
    gc.collect()
    gc.freeze()
    try:
        return _offer(client, body, rate, seconds, timeout_s, n)
    finally:
        gc.unfreeze()


def _offer(client: httpx.Client, body: dict, rate: float, seconds: float, timeout_s: float, n: int) -> list[Result]:
    t0 = time.perf_counter()
    out: list[Result] = []
    lock = threading.Lock()

    def run(i: int):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        r = one(client, body, timeout_s, t0)
        with lock:
            out.append(r)
    with cf.ThreadPoolExecutor(max_workers=min(n, 256)) as pool:
        list(pool.map(run, range(n)))
    return sorted(out, key=lambda r: r.sent_at)


def p(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summary(base_ttfts: list[float], capacity: float, rate: float, results: list[Result]) -> dict:
    ok = [r for r in results if r.status == 200 and not r.error and r.ttft_s is not None]
    shed = [r for r in results if r.status in (429, 503)]
    base_p90 = p(base_ttfts, 0.9)
    acc_p90 = p([r.ttft_s for r in ok], 0.9)
    return {"unloaded_ttft_p50_s": statistics.median(base_ttfts), "unloaded_ttft_p90_s": base_p90,
            "capacity_rps": capacity, "offered_rps": rate, "sent": len(results), "accepted": len(ok),
            "shed_429": sum(r.status == 429 for r in shed), "shed_503": sum(r.status == 503 for r in shed),
            "shed_with_retry_after": sum(r.retry_after is not None for r in shed),
            "shed_latency_p50_s": p([r.headers_s for r in shed], 0.5),
            "shed_latency_p90_s": p([r.headers_s for r in shed], 0.9),
            "shed_latency_max_s": max((r.headers_s for r in shed), default=None),
            "timeouts": sum(r.timed_out for r in results),
            "other": sum(1 for r in results if r not in ok and r not in shed and not r.timed_out),
            "accepted_ttft_p50_s": p([r.ttft_s for r in ok], 0.5), "accepted_ttft_p90_s": acc_p90,
            "accepted_p90_ratio": (acc_p90 / base_p90) if acc_p90 and base_p90 else None,
            "loadavg": open("/proc/loadavg").read().split()[:3]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=os.environ.get("KVNOTES_API_KEY"))
    ap.add_argument("--prompt-words", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--unloaded", type=int, default=8, help="sequential requests for the unloaded TTFT and capacity")
    ap.add_argument("--multiplier", type=float, default=4.0)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--timeout", type=float, default=60.0, help="client timeout per request")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    key = a.api_key
    if key is None:
        path = os.path.expanduser("~/.local/share/kvnotes/api_key")
        key = open(path).read().strip() if os.path.exists(path) else None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = body_of(a.prompt_words, a.max_tokens)
    with httpx.Client(base_url=a.url, headers=headers, limits=httpx.Limits(max_connections=512)) as client:
        one(client, body, a.timeout, time.perf_counter())          # warm
        base, cap = unloaded(client, body, a.unloaded, a.timeout)
        rate = a.multiplier * cap
        res = offer(client, body, rate, a.seconds, a.timeout)
    out = summary(base, cap, rate, res)
    print(json.dumps(out, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"summary": out, "results": [asdict(r) for r in res]}, f, indent=1)


if __name__ == "__main__":
    main()
