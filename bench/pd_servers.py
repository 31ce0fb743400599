"""vLLM's own disaggregated prefill/decode for ``bench.vllm_pd``: two OpenAI servers with
``NixlConnector`` (``kv_buffer_device: cpu``) and a small proxy, as vLLM's examples run it.

- :class:`PDServers` starts a producer (``kv_producer``) and a consumer (``kv_consumer``)
  ``python -m vllm.entrypoints.openai.api_server`` with distinct ``VLLM_NIXL_SIDE_CHANNEL_PORT``s
  (optionally with NIXL's busy-polling progress thread off: ``quiet_nixl``) and stops both by PID (SIGTERM, then SIGKILL of the group each one leads) on exit, error or
  Ctrl-C, then removes the ``psm_*`` shared memory a killed server leaves in ``/dev/shm``
  (:mod:`bench.vllm_shm`).
- :func:`pd_request` is the proxy: a prefill request with ``max_tokens: 1`` and
  ``kv_transfer_params: {"do_remote_decode": true, ...}``, then the decode request (streamed)
  carrying the ``kv_transfer_params`` the producer returned. Its decode leg is timed from the
  decode request being sent to the first streamed token: NIXL pull + load into the paged cache
  + first token.
- The consumer's pull bytes and seconds come from its Prometheus series
  (``vllm:nixl_bytes_transferred``, ``vllm:nixl_xfer_time_seconds``), read before and after.

The request bodies and the Prometheus parsing are pure functions (tests/test_bench_vllm_pd.py).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.vllm_shm import psm_names, remove_leaked, wait_group_exit

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)")
NIXL_SERIES = ("vllm:nixl_bytes_transferred", "vllm:nixl_xfer_time_seconds")


# ---- pure parts -------------------------------------------------------------------------------
def kv_transfer_config(role: str) -> str:
    if role not in ("kv_producer", "kv_consumer"):
        raise ValueError(f"role must be kv_producer or kv_consumer, got {role!r}")
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"})


def server_command(python: str, ckpt: str, name: str, port: int, role: str, dtype: str, max_model_len: int) -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", ckpt, "--tokenizer", ckpt,
            "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--enforce-eager", "--max-model-len", str(max_model_len), "--seed", "0",
            "--kv-transfer-config", kv_transfer_config(role)]


QUIET_DIR = Path(__file__).resolve().parent / "nixl_quiet"


def server_env(base: dict[str, str], side_port: int, kv_gib: int, threads: int, quiet: bool = False) -> dict[str, str]:
    """The servers' environment; ``quiet``: NIXL agents without their busy-polling progress thread
    (``bench/nixl_quiet/sitecustomize.py``)."""
    env = dict(base)
    env.update({"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
                "VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "OMP_NUM_THREADS": str(threads), "LMCACHE_TRACK_USAGE": "false", "PYTHONHASHSEED": "0",
                "UCX_RCACHE_MAX_UNRELEASED": "1024"})
    if quiet:
        env["KVNOTES_BENCH_NIXL_QUIET"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(QUIET_DIR), base.get("PYTHONPATH", "")) if p)
    return env


def prefill_body(model: str, prompt_ids: list[int], salt: str) -> dict:
    """The proxy's first leg: compute the prompt's KV on the producer and keep it for a pull."""
    return {"model": model, "prompt": list(prompt_ids), "max_tokens": 1, "temperature": 0.0, "stream": False,
            "cache_salt": salt,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                   "remote_block_ids": None, "remote_host": None, "remote_port": None}}


def decode_body(model: str, prompt_ids: list[int], kv_params: dict, max_tokens: int, salt: str) -> dict:
    """The second leg: the same prompt on the consumer, told where to pull the KV from."""
    if not kv_params or not kv_params.get("do_remote_prefill"):
        raise ValueError(f"the producer returned no usable kv_transfer_params: {kv_params!r}")
    return {"model": model, "prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "return_token_ids": True, "cache_salt": salt, "kv_transfer_params": kv_params}


def prometheus_sums(text: str, names: tuple[str, ...] = NIXL_SERIES) -> dict[str, float]:
    """``{name_sum: total, name_count: total}`` over every label set of the histograms ``names``."""
    out = {f"{n}_{s}": 0.0 for n in names for s in ("sum", "count")}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) in out:
            try:
                out[m.group(1)] += float(m.group(3))
            except ValueError:
                raise ValueError(f"unparsable Prometheus sample: {line!r}") from None
    return out


def sse_events(lines):
    """The JSON payloads of an OpenAI server-sent-event stream (``data: {...}`` lines until ``[DONE]``)."""
    for line in lines:
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


# ---- the servers ------------------------------------------------------------------------------
@dataclass
class Server:
    role: str
    port: int
    proc: subprocess.Popen
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class PDServers:
    """Producer + consumer vLLM servers; a context manager that always stops both by PID."""

    def __init__(self, ckpt: str, name: str, dtype: str, *, kv_gib: int = 2, threads: int = 1,
                 max_model_len: int = 8192, log_dir: Path = Path("runs/vllm_pd"), start_timeout: float = 600.0,
                 quiet_nixl: bool = False):
        from kvtransport.tier.server import free_port

        self.name, self.start_timeout = name, start_timeout
        log_dir.mkdir(parents=True, exist_ok=True)
        self.servers: list[Server] = []
        self.shm_before = psm_names()      # the shm segments that are not ours to remove
        try:
            for role in ("kv_producer", "kv_consumer"):
                port, side = free_port("127.0.0.1"), free_port("127.0.0.1")
                log = log_dir / f"{role}.log"
                with log.open("wb") as out:
                    proc = subprocess.Popen(server_command(sys.executable, ckpt, name, port, role, dtype, max_model_len),
                                            env=server_env(os.environ, side, kv_gib, threads, quiet_nixl), stdout=out,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
                self.servers.append(Server(role, port, proc, log))
        except BaseException:          # the first server must not outlive a failed start of the second
            self.stop()
            raise
        self.producer, self.consumer = self.servers

    def __enter__(self) -> "PDServers":
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_ready(self) -> None:
        import httpx
        deadline = time.monotonic() + self.start_timeout
        for s in self.servers:
            while True:
                if s.proc.poll() is not None:
                    raise RuntimeError(f"vLLM {s.role} exited ({s.proc.returncode}); log tail:\n{_tail(s.log)}")
                try:
                    if httpx.get(s.url + "/health", timeout=2.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM {s.role} not ready in {self.start_timeout:.0f} s; log tail:\n{_tail(s.log)}")
                time.sleep(1.0)

    def stop(self) -> None:
        """SIGTERM each server (it stops its engine core), then SIGKILL whatever is left of the
        process group that server leads (start_new_session: the group is exactly its children),
        then remove the ``psm_*`` segments that appeared since start and that no live process maps."""
        for s in self.servers:
            if s.proc.poll() is None:
                s.proc.send_signal(signal.SIGTERM)
        for s in self.servers:
            try:
                s.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(s.proc.pid, signal.SIGKILL)      # the group id is the server's own pid
            except (ProcessLookupError, PermissionError):
                pass
            try:
                s.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                print(f"vLLM {s.role} pid {s.proc.pid} did not exit", file=sys.stderr)
            if not wait_group_exit(s.proc.pid):
                print(f"vLLM {s.role}'s process group {s.proc.pid} still has live processes", file=sys.stderr)
        remove_leaked(self.shm_before)     # what SIGKILL left in /dev/shm (logged), not what others map

    def nixl_sums(self) -> dict[str, float]:
        import httpx
        return prometheus_sums(httpx.get(self.consumer.url + "/metrics", timeout=10.0).text)


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return "(no log)"


def pd_request(srv: PDServers, prompt_ids: list[int], max_tokens: int, salt: str) -> dict:
    """One request through the proxy. Returns prefill/decode leg seconds, the generated token ids,
    and the consumer's NIXL pull (bytes, seconds) for this request."""
    import httpx

    before = srv.nixl_sums()
    t0 = time.perf_counter()
    r = httpx.post(srv.producer.url + "/v1/completions", json=prefill_body(srv.name, prompt_ids, salt), timeout=600.0)
    if r.status_code != 200:
        raise RuntimeError(f"prefill request failed: {r.status_code} {r.text[:500]}")
    prefill = time.perf_counter() - t0
    params = r.json().get("kv_transfer_params")
    body = decode_body(srv.name, prompt_ids, params, max_tokens, salt)
    t1 = time.perf_counter()
    first, ids, text = None, [], ""
    with httpx.stream("POST", srv.consumer.url + "/v1/completions", json=body, timeout=600.0) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"decode request failed: {resp.status_code} {resp.read()[:500]!r}")
        for ev in sse_events(resp.iter_lines()):
            for c in ev.get("choices") or []:
                if c.get("token_ids") or c.get("text"):
                    first = first if first is not None else time.perf_counter() - t1
                ids += c.get("token_ids") or []
                text += c.get("text") or ""
    if first is None:
        raise RuntimeError("the decode leg streamed no token")
    after = srv.nixl_sums()
    for _ in range(10):        # the connector's stats reach /metrics with the engine's next stats update
        if after["vllm:nixl_xfer_time_seconds_count"] > before["vllm:nixl_xfer_time_seconds_count"]:
            break
        time.sleep(0.5)
        after = srv.nixl_sums()
    return {"prefill_leg": prefill, "decode_leg": first, "tokens": ids, "text": text,
            "pull_bytes": after["vllm:nixl_bytes_transferred_sum"] - before["vllm:nixl_bytes_transferred_sum"],
            "pull_seconds": after["vllm:nixl_xfer_time_seconds_sum"] - before["vllm:nixl_xfer_time_seconds_sum"],
            "pulls": after["vllm:nixl_xfer_time_seconds_count"] - before["vllm:nixl_xfer_time_seconds_count"]}
