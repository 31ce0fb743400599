"""bench.vllm_shm: after a (killed) vLLM's process group is gone, the ``psm_*``
segments that appeared since the snapshot and that no live process maps are removed; the rest
stays. In a tmp dir with a real child process holding one file mapped; no vLLM."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

from bench.vllm_shm import psm_names, remove_leaked, wait_group_exit

MAP_AND_SLEEP = """
import mmap, sys, time
f = open(sys.argv[1], "r+b")
m = mmap.mmap(f.fileno(), 0)
f.close()
print("mapped", flush=True)
time.sleep(120)
"""


def _write(path, n):
    path.write_bytes(b"\0" * n)


def test_removes_only_new_unmapped_psm_files(tmp_path, caplog):
    _write(tmp_path / "psm_x", 4096)                 # there before the server: not ours
    before = psm_names(tmp_path)
    assert before == {"psm_x"}
    _write(tmp_path / "psm_y", 3 * 4096)             # leaked by the "server"
    _write(tmp_path / "psm_z", 4096)                 # new, but a live process maps it
    _write(tmp_path / "other", 4096)                 # not a multiprocessing segment
    holder = subprocess.Popen([sys.executable, "-c", MAP_AND_SLEEP, str(tmp_path / "psm_z")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "mapped"
        with caplog.at_level(logging.WARNING, logger="bench.vllm_shm"):
            sweep = remove_leaked(before, tmp_path)
        assert sweep.removed == ("psm_y",)
        assert sweep.removed_bytes == 3 * 4096
        assert sweep.mapped == ("psm_z",)
        assert sweep.failed == ()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "psm_x", "psm_z"]
        assert "removed 1 leaked vLLM shared-memory segment(s)" in caplog.text and "12288 bytes" in caplog.text
        assert "psm_z" in caplog.text                  # the kept one is reported too
    finally:
        holder.kill()
        holder.wait(timeout=10)
    # once its holder is gone, psm_z is a leak like any other
    sweep = remove_leaked(before, tmp_path)
    assert (sweep.removed, sweep.removed_bytes, sweep.mapped) == (("psm_z",), 4096, ())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "psm_x"]


def test_nothing_new_is_a_no_op(tmp_path):
    _write(tmp_path / "psm_a", 10)
    before = psm_names(tmp_path)
    sweep = remove_leaked(before, tmp_path)
    assert (sweep.removed, sweep.removed_bytes, sweep.mapped) == ((), 0, ())
    assert (tmp_path / "psm_a").exists()
    assert psm_names(tmp_path / "missing") == frozenset()


def test_wait_group_exit_follows_a_killed_process_group():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        assert wait_group_exit(proc.pid, timeout_s=0.3) is False      # alive: times out
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert wait_group_exit(proc.pid, timeout_s=10) is True
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
