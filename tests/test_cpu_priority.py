"""kvruntime.cpu_priority: a model worker lowers the priority of every thread of its process (the
ones it starts later inherit it), never raises one; a router replica at no higher priority than the
model says so. Each case runs in its own process (a niceness cannot be raised back unprivileged)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness: Linux")


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout + out.stderr


def test_every_thread_is_lowered_and_later_threads_inherit_it():
    out = _run("""
        import os, threading, time
        from kvruntime.cpu_priority import lower_priority
        stop = threading.Event()
        nicer = []
        def spin():                      # a thread that exists before the call
            stop.wait()
        def already_nicer():             # a thread already lower than asked: left where it is
            os.setpriority(os.PRIO_PROCESS, 0, 12); nicer.append(threading.get_native_id()); stop.wait()
        ts = [threading.Thread(target=spin), threading.Thread(target=already_nicer)]
        [t.start() for t in ts]
        while not nicer: time.sleep(0.01)
        base = os.getpriority(os.PRIO_PROCESS, 0)
        assert lower_priority(base + 7) == base + 7
        got = {int(t): os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")}
        later = []
        t = threading.Thread(target=lambda: later.append(os.getpriority(os.PRIO_PROCESS, 0))); t.start(); t.join()
        stop.set(); [t.join() for t in ts]
        print("BASE", base, "GOT", sorted(set(v for k, v in got.items() if k != nicer[0])), "NICER", got[nicer[0]],
              "LATER", later[0])
    """)
    line = next(l for l in out.splitlines() if l.startswith("BASE"))
    base = int(line.split()[1])
    assert f"GOT [{base + 7}]" in line and f"LATER {base + 7}" in line, line
    assert f"NICER {max(12, base + 7)}" in line, line


def test_a_replica_no_higher_than_the_model_warns():
    out = _run("""
        import logging, os
        logging.basicConfig(level=logging.INFO)
        from kvruntime.cpu_priority import check_control_plane
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        check_control_plane(mine + 1)       # higher than the model: nothing said
        print("QUIET")
        check_control_plane(mine)           # level with it: a warning naming the fix
    """)
    quiet, rest = out.split("QUIET", 1)
    assert "niceness" not in quiet
    assert "no higher CPU priority than the model workers" in rest and "RAY_worker_niceness=0" in rest
