"""Process-wide settings around LMCache, kept in one place.

LMCache reads its settings at import time and changes process globals when an engine starts
(``multiprocessing`` start method forced to ``spawn``; ``PROMETHEUS_MULTIPROC_DIR`` set to
``/tmp/lmcache_prometheus``, which child processes would inherit and then write metric files
into). :func:`prepare` runs before any LMCache import; :func:`contained_globals` wraps engine
construction and puts those globals back. Telemetry is always off (``LMCACHE_TRACK_USAGE=false``).
"""
from __future__ import annotations

import multiprocessing
import os
import sys
from contextlib import contextmanager
from typing import Iterator

_FORCED = {"LMCACHE_TRACK_USAGE": "false"}      # never overridable: no telemetry from kvnotes
_DEFAULTS = {"LMCACHE_LOG_LEVEL": "WARNING"}    # LMCache logs every store/retrieve at INFO


def prepare() -> None:
    """Set LMCache's import-time environment in this process. Idempotent; cheap."""
    os.environ.update(_FORCED)
    for k, v in _DEFAULTS.items():
        os.environ.setdefault(k, v)


def child_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a subprocess that runs LMCache (server or client)."""
    env = dict(os.environ if base is None else base)
    env.update(_FORCED)
    for k, v in _DEFAULTS.items():
        env.setdefault(k, v)
    return env


@contextmanager
def contained_globals() -> Iterator[None]:
    """Run LMCache engine construction, then restore the globals it changes (see module doc).

    While it runs, vLLM is not importable unless this process already imported it: LMCache's
    token database imports vLLM (``vllm.utils.hashing``, ``vllm.v1.core``) only to borrow its
    prefix hash, which kvnotes replaces with its own (``StableTokenDatabase``); that import alone
    took 3-5 s of CPU in every prefill worker that never runs vLLM."""
    prom = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    method = multiprocessing.get_start_method(allow_none=True)
    hide_vllm = "vllm" not in sys.modules
    if hide_vllm:
        sys.modules["vllm"] = None          # `import vllm...` raises ImportError, which LMCache handles
    try:
        yield
    finally:
        if hide_vllm and sys.modules.get("vllm", 0) is None:
            del sys.modules["vllm"]
        if prom is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = prom
        if multiprocessing.get_start_method(allow_none=True) != method:
            multiprocessing.set_start_method(method, force=True)
