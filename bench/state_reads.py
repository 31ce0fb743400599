"""The request path's prompt-index read (``get_prompt_blocks``: the ``lookup_state`` lap of a plain
prompt) against the real SQLite state store while other threads write, in one process (no cluster).

    python -m bench.state_reads [--reads 200] [--hold-s 1.0] [--impl path/to/sqlite.py] [--read session]

Two cases: ``held``: one read while another connection holds a write transaction open for
``--hold-s`` seconds (a store-behind record, an anchor merge, an expiry); ``writers``: ``--reads``
reads (33 hashes: an 8k-token prompt's block bounds) while 3 threads write what the router writes
after requests (10k fingerprints present; span entries, counts, held prompts, decode-held records,
prompt blocks; an expiry every 64 writes). ``--impl``: load ``SqliteState`` from another file (an
earlier revision, ``git show REV:cluster/control/state/sqlite.py > /tmp/old.py``) for a before/after
side by side. ``--read session``: the read measured is ``get_session`` (a native session's next
turn) instead. Prints seconds per read (median, p99, max) and the load (``os.getloadavg``).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from cluster.control.prompt_index import block_bounds, prompt_hash


def load_store(impl: str | None):
    if impl is None:
        from cluster.control.state.sqlite import SqliteState
        return SqliteState
    spec = importlib.util.spec_from_file_location("old_sqlite_state", impl)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.SqliteState


def _fill(s, tenant: str, prompt: tuple[int, ...], now: float) -> list[str]:
    s.put_fingerprints(tenant, {f"fp{i}": "x" * 64 for i in range(10_000)}, now)
    s.put_prompt_blocks(tenant, {prompt_hash(tenant, prompt[:b]): b for b in block_bounds(len(prompt))}, now)
    s.put_session(tenant, "s1", "{}" * 2000, now)
    return [prompt_hash(tenant, prompt[:b]) for b in block_bounds(len(prompt))]


def reader(s, tenant: str, hashes: list[str], what: str):
    """The read measured: the prompt index's blocks (``prompt``) or a session (``session``)."""
    if what == "session":
        return lambda: 0 if s.get_session(tenant, "s1", time.time()) is None else len(hashes)
    return lambda: len(s.get_prompt_blocks(tenant, hashes, time.time()))


def held_case(s, path: Path, hashes: list[str], tenant: str, hold_s: float, read) -> float:
    import sqlite3
    w = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    w.execute("BEGIN IMMEDIATE")
    w.execute("UPDATE fingerprints SET used=used WHERE key='fp0'")
    release = threading.Timer(hold_s, lambda: w.execute("COMMIT"))
    release.start()
    t0 = time.perf_counter()
    got = read()
    took = time.perf_counter() - t0
    release.join()
    w.close()
    assert got == len(hashes), got
    return took


def _writer(s, tenant: str, k: int, stop: threading.Event) -> None:
    i = 0
    while not stop.is_set():
        now, i = time.time(), i + 1
        s.put_fingerprints(tenant, {f"fp{(k * 7919 + i * 97 + j) % 10_000}": "y" * 64 for j in range(300)}, now)
        s.count_fingerprints(tenant, [f"c{k}-{i}-{j}" for j in range(64)], now)
        s.put_held_prompt(tenant, f"held{k}-{i % 50}", list(range(8192)), now)
        s.put_decode_held(tenant, {f"d{k}-{i}-{j}": 256 * j for j in range(32)}, now)
        s.put_prompt_blocks(tenant, {f"p{k}-{i}-{j}": 256 * j for j in range(32)}, now)


def writers_case(s, hashes: list[str], tenant: str, reads: int, read) -> list[float]:
    stop = threading.Event()
    threads = [threading.Thread(target=_writer, args=(s, tenant, k, stop), daemon=True) for k in range(3)]
    for t in threads:
        t.start()
    out = []
    try:
        for _ in range(reads):
            t0 = time.perf_counter()
            read()
            out.append(time.perf_counter() - t0)
            time.sleep(0.005)
    finally:
        stop.set()
        for t in threads:
            t.join()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reads", type=int, default=200)
    ap.add_argument("--hold-s", type=float, default=1.0)
    ap.add_argument("--impl", default=None)
    ap.add_argument("--read", default="prompt", choices=["prompt", "session"])
    a = ap.parse_args(argv)
    store_cls = load_store(a.impl)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "state.db"
        s, tenant = store_cls(str(path)), "acme"
        hashes = _fill(s, tenant, tuple(range(8192)), time.time())
        read = reader(s, tenant, hashes, a.read)
        held = held_case(s, path, hashes, tenant, a.hold_s, read)
        lat = sorted(writers_case(s, hashes, tenant, a.reads, read))
        s.close()
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
    print(f"impl={a.impl or 'cluster.control.state.sqlite'} read={a.read} load={os.getloadavg()}")
    print(f"held   : one read during a {a.hold_s:.1f} s write transaction: {held * 1e3:.1f} ms")
    print(f"writers: {len(lat)} reads beside 3 writers: median {statistics.median(lat) * 1e3:.2f} ms, "
          f"p99 {p99 * 1e3:.1f} ms, max {lat[-1] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
