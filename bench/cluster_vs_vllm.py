"""kvnotes through the whole cluster vs plain vLLM, started by one command, measured side by side.

    python -m bench.cluster_vs_vllm [--quick] [--json runs/cluster_vs_vllm.json] [--plots docs/img]
    python -m bench.cluster_vs_vllm --from-json runs/cluster_vs_vllm.json    # tables of a saved run

The JSON is saved after every size, so a run cut short (Ctrl-C, SIGTERM, an error) keeps and
prints what it measured, marked incomplete.

Starts, in this order, and stops by PID / Ray shutdown on exit, Ctrl-C or error (then removes the
``psm_*`` shared memory a SIGKILLed vLLM leaves in ``/dev/shm``: :mod:`bench.vllm_shm`):

* **plain vLLM**: ``python -m vllm.entrypoints.openai.api_server`` (a child process group) on the
  same converted checkpoint and dtype as the cluster's vLLM decode engine, eager, automatic prefix
  caching on, the same KV space (``VLLM_CPU_KVCACHE_SPACE``) and max length, 1 OpenMP thread.
* **the kvnotes cluster**: ``cluster.operator.launcher.start`` with ``decode_engine: vllm`` (Ray actors:
  one prefill actor with the LMCache tier, one decode actor running vLLM + the kvnotes KV
  connector; the transport ``auto`` picks; the Serve router over HTTP with its API key; shadow
  checks off so no background recompute competes).

Both run at the same time (~9 GiB together) and every measurement interleaves the two, so both see
the same machine state. TTFT is client-side over HTTP for both: from sending the request to the
first streamed token (SSE, ``stream: true`` both), same prompt token ids and ``max_tokens``.
Plain vLLM gets token ids on ``/v1/completions``; kvnotes the native ``/v1/notes/completions``
(compose, field edit: the segments that render to exactly those ids) or ``/v1/completions``
with the same ids (cold). Workloads at each size (1k/4k/8k): compose (registered skills + a
question, ``kv_policy: fast``) vs vLLM recompute (fresh ``cache_salt``) and vs vLLM's exact
prefix-cache hit (the same prompt and salt again); cold (a prompt that reuses nothing); a
field-edit session (one template field early, changed each turn, kvnotes ``session`` vs vLLM
with APC); then a mixed Poisson load (compose + cold + edit). The in-process compose time (the
reference engine composing the same chunk KV in this process, ``kvruntime.ops.compose``) gives
the in-process speed-up over the same vLLM recompute; ``kept`` = in-process time / cluster time.
Tables: ``bench.cluster_vs_vllm_report``; the mixed load: ``bench.cluster_vs_vllm_load``.
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
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import httpx

from bench.cluster_vs_vllm_load import STATUSES, cold_ids, edit_turn, mixed_load, register_template
from bench.cluster_vs_vllm_report import markdown
from bench.progress import progress as _progress
from bench.vllm_shm import psm_names, remove_leaked, wait_group_exit

QUESTIONS = ["Summarise the key facts above in one sentence.", "Which organisation is mentioned first?",
             "List two numbers that appear above.", "What is the main topic of the last section?"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream(client: httpx.Client, path: str, body: dict) -> dict:
    """POST ``body`` streamed; seconds to the first token event, and what the final events say."""
    t = time.perf_counter()
    first, out = None, {}
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(f"{path}: {ev['error']}")
            tok = ev.get("token") or (ev.get("choices") and ev["choices"][0].get("text"))
            if tok and first is None:
                first = time.perf_counter() - t
            if ev.get("usage"):
                out["prompt"] = ev["usage"]["prompt_tokens"]
                out["cached"] = (ev["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            info = ev.get("kvnotes") or (ev if "plan" in ev else None)
            if info:
                out.update(plan=info["plan"], fallbacks=info.get("fallbacks", []),
                           stages=info.get("explain", {}).get("stages", {}),
                           control=info.get("explain", {}).get("control", {}),    # the router's laps
                           transport=info.get("explain", {}).get("transport", ""))
    return {"ttft": first if first is not None else time.perf_counter() - t, **out}


class Systems:
    """Plain vLLM's OpenAI server and the kvnotes cluster, both up; ``close`` stops both."""

    def __init__(self, model: str, dtype: str, kv_gib: int, tier_gib: float, workdir: Path):
        self.proc, self.cfg, self.workdir, self.kv_gib, self.tier_gib = None, None, workdir, kv_gib, tier_gib
        from kvruntime.checkpoint import ensure_checkpoint
        from kvruntime.models import get_model_spec
        import transformers
        from cluster.control.render import Renderer
        self.spec = get_model_spec(model)
        self.ckpt = ensure_checkpoint(self.spec)
        tok = transformers.AutoTokenizer.from_pretrained(self.ckpt)
        self.render = Renderer(tok, self.spec, None, tok.bos_token_id)   # the router's tokenization, no registry
        self.model, self.dtype = model, dtype

    def start(self) -> None:
        """Start both (``close`` stops whatever of them started)."""
        kv_gib, tier_gib, workdir, model, dtype, ckpt = (self.kv_gib, self.tier_gib, self.workdir, self.model,
                                                         self.dtype, self.ckpt)
        # 1. the cluster
        from kvruntime.config import ClusterConfig
        from cluster.operator.launcher import start
        self.cfg = ClusterConfig.of(port=_port(), model=model, dtype=dtype, decode_engine="vllm", vllm_kv_cache_bytes=kv_gib << 30,
                                 vllm_max_model_len=8192, tier_cpu_bytes=int(tier_gib * 2**30), shadow_fraction=0.0,
                                 data_dir=str(workdir / "state"))
        with contextlib.redirect_stdout(sys.stderr):     # the throwaway API key's banner: not into the table
            start(self.cfg, local_cpus=4)
        key = self.cfg.state.api_key_file.read_text().strip()
        self.kv = httpx.Client(base_url=f"http://127.0.0.1:{self.cfg.server.port}", timeout=900,
                               headers={"authorization": f"Bearer {key}"})
        # 2. plain vLLM (after Ray is up: starting both at once overloads 2 cores)
        vport = _port()
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "OMP_NUM_THREADS": "1"}
        log = open(workdir / "vllm_server.log", "w")
        self.shm_before = psm_names()                      # shm segments that are not this server's
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt), "--tokenizer", str(ckpt),
             "--served-model-name", model, "--dtype", dtype, "--enforce-eager", "--enable-prefix-caching",
             "--max-model-len", "8192", "--seed", "0", "--enable-prompt-tokens-details", "--host", "127.0.0.1",
             "--port", str(vport)], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.vllm = httpx.Client(base_url=f"http://127.0.0.1:{vport}", timeout=900)
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited ({self.proc.returncode}); see {workdir / 'vllm_server.log'}: "
                                   + (workdir / "vllm_server.log").read_text()[-600:])
            try:
                if self.vllm.get("/health").status_code == 200 and self.kv.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("vLLM server or kvnotes router not healthy after 600 s")
            time.sleep(1)

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGTERM)     # the server and its engine-core child
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(30)
            # what is left of the group (the engine core), even when the server itself died
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            wait_group_exit(self.proc.pid)
            remove_leaked(self.shm_before)                  # the psm_* segments SIGKILL left in /dev/shm (logged)
        if self.cfg is not None:
            from cluster.operator.launcher import stop
            stop(self.cfg)                                # Serve, the actors, then ray.shutdown()

    # ---- one request on each system ------------------------------------------------------------
    def vllm_ids(self, ids: list[int], salt: str, n: int) -> dict:
        body = {"model": self.model, "prompt": ids, "max_tokens": n, "temperature": 0, "cache_salt": salt,
                "stream_options": {"include_usage": True}}
        return stream(self.vllm, "/v1/completions", body)

    def kv_native(self, body: dict, n: int) -> dict:
        r = stream(self.kv, "/v1/notes/completions", {**body, "max_tokens": n, "temperature": 0, "explain": True})
        if r.get("fallbacks"):         # kept (the table counts them): a fallback is part of what users get
            print(f"kvnotes request fell back: {r['fallbacks']}", file=sys.stderr, flush=True)
        return r

    def kv_ids(self, ids: list[int], n: int) -> dict:
        return stream(self.kv, "/v1/completions", {"model": self.model, "prompt": ids, "max_tokens": n,
                                                   "temperature": 0, "explain": True,
                                                   "stream_options": {"include_usage": True}})

    # ---- prompts: the same token ids the router renders -------------------------------------------
    def text(self, offset: int, n_tokens: int) -> str:
        """About ``n_tokens`` tokens (never more) of the shipped passages, from word ``offset``."""
        from kvruntime.fidelity.cases import load_passages
        words = " ".join(load_passages().values()).split()
        n = n_tokens
        while True:
            t = " ".join(words[(offset + i) % len(words)] for i in range(n))
            got = len(self.render.encode(t))
            if got <= n_tokens:
                return t
            n = int(n * n_tokens / got * 0.99)

    def question(self, text: str) -> list[int]:
        return self.render.user_then_markup(text, self.spec.chat_user_suffix)

    def template_ids(self, text: str, value: str) -> list[int]:
        t = SimpleNamespace(name="t", text=text, fields=("status",), labels={}, version=1)
        return list(self.render.frame()) + list(self.render.render_template(t, {"status": value}).token_ids)


def _compose(s: Systems, size: int, reps: int, n: int, tag: str) -> tuple[dict, list[list[int]]]:
    k = max(2, round(size / 1024))
    names, chunks = [], []
    for i in range(k):
        text = s.text(i * size // k + size, int(size * 0.96 / k))
        name = f"{tag}-{size}-{i}"
        r = s.kv.post("/v1/skills", json={"name": name, "text": text})
        if r.status_code != 201:
            raise RuntimeError(f"registering {name}: HTTP {r.status_code} {r.text[:200]}")
        names.append(name)
        chunks.append(list(s.render.chunk_ids(text)))
    out = {"kvnotes": [], "vllm_recompute": [], "vllm_hit": []}
    for rep in range(reps):                       # order rotated: each rep starts with another chunk
        order = [(rep + j) % k for j in range(k)]
        q = f"{QUESTIONS[rep % len(QUESTIONS)]} (ref {uuid.uuid4().hex[:6]})"
        ids = list(s.render.frame()) + [t for j in order for t in chunks[j]] + s.question(q)
        kv = s.kv_native({"segments": [{"skill": names[j]} for j in order] + [{"text": q}], "kv_policy": "fast"}, n)
        if kv.get("prompt") != len(ids):
            raise RuntimeError(f"kvnotes rendered {kv.get('prompt')} tokens, plain vLLM gets {len(ids)}")
        salt = uuid.uuid4().hex
        out["kvnotes"].append(kv)
        out["vllm_recompute"].append(s.vllm_ids(ids, salt, n))
        out["vllm_hit"].append(s.vllm_ids(ids, salt, n))          # the same prompt and salt again: APC hit
    return out, chunks


def _cold(s: Systems, size: int, reps: int, n: int) -> dict:
    out = {"kvnotes": [], "vllm": []}
    for rep in range(reps):
        ids = cold_ids(s, size, rep)
        out["kvnotes"].append(s.kv_ids(ids, n))
        out["vllm"].append(s.vllm_ids(ids, uuid.uuid4().hex, n))
    return out


def _edit(s: Systems, size: int, turns: int, n: int, tag: str) -> dict:
    name, text = register_template(s, size, tag)
    session, salt = f"{tag}-{size}-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    out = {"kvnotes": [], "vllm": []}
    for turn in range(turns + 1):                 # turn 0 fills both caches (not counted)
        kv, v = edit_turn(s, name, text, session, salt, STATUSES[turn % len(STATUSES)], n)
        if turn:
            out["kvnotes"].append(kv)
            out["vllm"].append(v)
    return out


def _inprocess(engine, chunks: list[list[int]], reps: int, frame, q) -> list[float]:
    """The same compose in this process (reference engine, 1 thread, chunk KV in memory)."""
    from kvruntime.ops import ChunkSegment, TextSegment, compose, precompile_chunk
    segs = [TextSegment(list(frame))] + [ChunkSegment(precompile_chunk(engine, c)) for c in chunks] + [TextSegment(q)]
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        compose(engine, segs, seam_tokens=1)
        ts.append(time.perf_counter() - t)
    return ts


def _save(r: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(r, indent=1))


def _print(r: dict, plots: str) -> None:
    if plots:
        from bench.plots import plot_cluster_vs_vllm
        for p in plot_cluster_vs_vllm(r, Path(plots)):
            print(f"wrote {p}", file=sys.stderr)
    print(f"# kvnotes cluster vs plain vLLM: {r['model']} {r['dtype']}, vLLM {r.get('vllm')}, {r['machine']}, "
          f"max_tokens {r['max_tokens']}, run {r.get('seconds', 0):.0f} s"
          + (", load " + " -> ".join(f"{a[0]:.1f}" for a in r["loadavg"]) if r.get("loadavg") else "")
          + (" (INCOMPLETE: " + r["incomplete"] + ")" if r.get("incomplete") else "") + "\n")
    print(markdown(r))


def _args(argv):
    """The command line, checked (``ap.error`` exits 2 with one line on bad values)."""
    ap = argparse.ArgumentParser(prog="python -m bench.cluster_vs_vllm")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--sizes", type=int, nargs="*", default=[1024, 4096, 8000])
    # an 8k recompute takes ~2 min in plain vLLM fp32 on 2 cores: these defaults run ~25 min there
    ap.add_argument("--reps", type=int, nargs="*", default=[3, 2, 1], help="compose/cold reps per size (last repeats)")
    ap.add_argument("--turns", type=int, nargs="*", default=[6, 3, 2], help="measured field-edit turns per size")
    ap.add_argument("--rates", type=float, nargs="*", default=[0.5], help="mixed Poisson load rates (req/s)")
    ap.add_argument("--load-requests", type=int, default=9)
    ap.add_argument("--load-size", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kv-gib", type=int, default=1, help="vLLM KV space (GiB), each of the two engines")
    ap.add_argument("--tier-gib", type=float, default=1.0)
    ap.add_argument("--nominal-gbs", type=float, default=None,
                    help="the machine's nominal memory bandwidth (GB/s): a second byte floor beside the measured copy rate")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1k only, 1 rep, 2 edit turns, 3 load requests")
    ap.add_argument("--json", default="runs/cluster_vs_vllm.json")
    ap.add_argument("--plots", default="", help="folder for PNGs (e.g. docs/img; '' for none)")
    ap.add_argument("--from-json", metavar="FILE", help="print the tables (and --plots) of a saved run; start nothing")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.reps, args.turns, args.load_requests = [1024], [1], [2], 3
    if not args.from_json and (not args.sizes or any(not 256 <= x <= 8000 for x in args.sizes)
                               or min(args.reps + args.turns) < 1 or any(r <= 0 for r in args.rates)
                               or args.load_requests < 1):
        ap.error("sizes in 256..8000, reps/turns >= 1, rates > 0 and --load-requests >= 1 required")
    return args


def main(argv=None) -> int:
    args = _args(argv)
    if args.from_json:
        _print(json.loads(Path(args.from_json).read_text()), args.plots)
        return 0
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    pick = lambda xs, i: xs[min(i, len(xs) - 1)]  # noqa: E731
    workdir = Path(tempfile.mkdtemp(prefix="kvnotes-cvv-"))
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    tag = uuid.uuid4().hex[:6]
    t_start = time.perf_counter()
    r = {"model": args.model, "dtype": args.dtype, "max_tokens": args.max_tokens,
         "machine": f"{platform.machine()}, {os.cpu_count()} cores", "sizes": {}, "load": [],
         "loadavg": [os.getloadavg()]}     # 1/5/15-min load at the start and after each size
    s = Systems(args.model, args.dtype, args.kv_gib, args.tier_gib, workdir)
    try:
        print("starting plain vLLM (OpenAI server) and the kvnotes cluster (vLLM decode)...", file=sys.stderr, flush=True)
        s.start()
        r["vllm"] = __import__("vllm").__version__
        r["startup_s"] = time.perf_counter() - t_start
        # warm-up, not counted: each path's first request pays one-off costs (kernels, connections)
        _compose(s, 512, 1, args.max_tokens, f"{tag}-warm"), _cold(s, 512, 1, args.max_tokens)
        _edit(s, 512, 1, args.max_tokens, f"{tag}-warm")
        import torch
        from kvruntime.engine import ReferenceEngine
        torch.set_num_threads(1)
        ref = ReferenceEngine(args.model, dtype=args.dtype, threads=1)     # in-process compose, 1 thread
        from bench.decode_leg import copy_gbs
        per_token = ref.num_layers * 2 * ref.kv_heads * ref.head_dim * torch.empty(0, dtype=ref.dtype).element_size()
        # the decode leg's byte floor (bench.cluster_vs_vllm_report.floor_rows): the KV moved once
        r["device"] = {"copy_gbs": copy_gbs(per_token * 4096), "nominal_gbs": args.nominal_gbs,
                       "kv_bytes_per_token": per_token}
        r["inprocess"] = {}
        for i, size in enumerate(_progress(args.sizes, "context sizes")):
            w = {}
            w["compose"], chunks = _compose(s, size, pick(args.reps, i), args.max_tokens, tag)
            # in this process while both systems are up (idle): the machine state the cluster saw
            r["inprocess"][str(size)] = _inprocess(ref, chunks, 1 if args.quick else 2, s.render.frame(),
                                                   s.question(QUESTIONS[0]))
            w["cold"] = _cold(s, size, pick(args.reps, i), args.max_tokens)
            w["edit"] = _edit(s, size, pick(args.turns, i), args.max_tokens, tag)
            r["sizes"][str(size)] = w
            r["loadavg"].append(os.getloadavg())
            _save(r, args.json)                      # a run cut short keeps what it measured
        for rate in _progress(args.rates, "mixed load rates"):
            r["load"] += mixed_load(s, rate, args.load_requests, args.load_size, args.max_tokens, 7, tag)
    except BaseException as exc:                     # Ctrl-C, SIGTERM, an error: save, report, stop
        r["incomplete"] = f"{type(exc).__name__}: {exc}"[:300]
        raise
    finally:
        s.close()
        shutil.rmtree(workdir, ignore_errors=True)
        r["seconds"] = time.perf_counter() - t_start
        _save(r, args.json)
        if r["sizes"]:
            _print(r, args.plots)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
