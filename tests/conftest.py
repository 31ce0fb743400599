"""Shared fixtures: real engines, loaded once per test session (each load is ~5 s)."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

_ENGINES: dict = {}


class DictSource:
    """An in-memory tier for executor/router tests (the shipped tier is LMCache, tested in test_tier*)."""

    def __init__(self):
        self.d = {}

    def get_kv(self, key):
        return self.d.get(key)

    def put_kv(self, key, kv):
        self.d[key] = kv


def get_engine(name: str):
    from kvruntime.engine import ReferenceEngine

    if name not in _ENGINES:
        # 1 thread: with Ray actors and test subprocesses on 2 cores, 2 threads ran ~25x slower
        _ENGINES[name] = ReferenceEngine(name, dtype="float32", threads=1)
    return _ENGINES[name]


@pytest.fixture(scope="module")
def one_torch_thread():
    """1 torch thread for a module: on this 2-core machine, with other jobs running, a prefill
    with 2 threads measured 25x slower than with 1 (OpenMP threads wait on each other)."""
    import torch
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="session")
def smol():
    return get_engine("smollm2-135m")


@pytest.fixture(scope="session")
def gemma():
    return get_engine("gemma3-270m")


@pytest.fixture(params=["smollm2-135m", "gemma3-270m"])
def engine(request):
    return get_engine(request.param)
