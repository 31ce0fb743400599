"""Starting local Ray: a raylet that never registers (Ray raises after 30 s and leaves the
half-started node's processes running) is cleaned up by PID and Ray is started again, up to
``ray_start_attempts``; a bad argument is not retried."""
from __future__ import annotations

import logging
import subprocess
import sys

import psutil
import pytest

from kvruntime.config import ClusterConfig

pytestmark = pytest.mark.ray          # starts real local Ray instances (start_local_ray)

RAY_ERROR = ("The current node timed out during startup. This could happen because some of the raylet failed to "
             "startup or the GCS has become overloaded.")


class _FailingFirst:
    """Stands in for ``ray.init`` on its first ``fails`` calls only: starts a real child process
    (what a half-started node leaves behind) and raises Ray's own error; then the real ray.init."""

    def __init__(self, real, fails: int):
        self.real, self.fails, self.orphans = real, fails, []

    def __call__(self, *a, **kw):
        if self.fails:
            self.fails -= 1
            self.orphans.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"]))
            raise Exception(RAY_ERROR)
        return self.real(*a, **kw)


def _gone(p: subprocess.Popen) -> bool:
    try:
        return psutil.Process(p.pid).status() == psutil.STATUS_ZOMBIE or p.poll() is not None
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def fresh_ray():
    import ray
    ray.shutdown()
    yield ray
    ray.shutdown()


def test_a_raylet_that_never_registers_is_cleaned_up_and_ray_started_again(fresh_ray, monkeypatch, caplog):
    from cluster.operator.launcher import start_local_ray

    fake = _FailingFirst(fresh_ray.init, fails=1)
    monkeypatch.setattr(fresh_ray, "init", fake)
    try:
        with caplog.at_level(logging.WARNING, logger="cluster.operator.launcher"):
            # 3 attempts: the fake fails the first; a real start on a busy CI machine may time out once
            # too (Ray's own "timed out during startup"), which is what the retry is for
            retries = start_local_ray(ClusterConfig.of(ray_start_attempts=3), local_cpus=1)
        assert 1 <= retries <= 2
        assert fresh_ray.is_initialized() and fresh_ray.cluster_resources().get("CPU") == 1.0
        assert _gone(fake.orphans[0]), "the failed attempt's process was left running"
        assert any("attempt 1 of 3" in r.getMessage() and "timed out during startup" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
    finally:
        for p in fake.orphans:
            p.kill()
            p.wait(timeout=10)


def test_the_last_attempt_raises_rays_error_and_leaves_nothing_running(fresh_ray, monkeypatch):
    from cluster.operator.launcher import start_local_ray

    fake = _FailingFirst(fresh_ray.init, fails=2)
    monkeypatch.setattr(fresh_ray, "init", fake)
    try:
        with pytest.raises(Exception, match="timed out during startup"):
            start_local_ray(ClusterConfig.of(ray_start_attempts=2), local_cpus=1)
        assert len(fake.orphans) == 2 and all(_gone(p) for p in fake.orphans)
        assert not fresh_ray.is_initialized()
    finally:
        for p in fake.orphans:
            p.kill()
            p.wait(timeout=10)


def test_a_bad_argument_is_not_retried(fresh_ray, monkeypatch):
    from cluster.operator.launcher import start_local_ray

    calls = []

    def bad(*a, **kw):
        calls.append(1)
        raise ValueError("num_cpus must be >= 0")

    monkeypatch.setattr(fresh_ray, "init", bad)
    with pytest.raises(ValueError):
        start_local_ray(ClusterConfig.of(ray_start_attempts=3), local_cpus=1)
    assert calls == [1]


def test_without_an_address_attaching_to_a_cluster_found_on_the_machine_is_said(fresh_ray, monkeypatch, caplog):
    """``kvnotes serve`` with no ``ray_address`` (``local_cpus`` None): Ray's ``address=None``
    attaches to any cluster it finds (``RAY_ADDRESS``, the latest ``ray start``): one warning names
    it; a fresh local Ray (``local_cpus`` given, or nothing found) is not warned about."""
    from cluster.operator.launcher import found_ray_address, start_local_ray

    calls = []
    monkeypatch.setattr(fresh_ray, "init", lambda **kw: calls.append(kw))     # Ray's start is not what is tested
    monkeypatch.setenv("RAY_ADDRESS", "10.9.8.7:6390")
    assert found_ray_address() == "10.9.8.7:6390"
    with caplog.at_level(logging.WARNING, logger="cluster.operator.launcher"):
        start_local_ray(ClusterConfig.of(), None)
        start_local_ray(ClusterConfig.of(), local_cpus=1)
    said = [r.getMessage() for r in caplog.records if "attaching to the Ray cluster" in r.getMessage()]
    assert len(said) == 1 and "10.9.8.7:6390" in said[0] and "RAY_ADDRESS=local" in said[0], said
    assert [c["address"] for c in calls] == [None, "local"]
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert found_ray_address() is None


def test_ray_start_attempts_is_validated():
    with pytest.raises(ValueError, match="ray_start_attempts"):
        ClusterConfig.of(ray_start_attempts=0)
