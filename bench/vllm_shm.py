"""Shared-memory segments a killed vLLM leaves behind, found and removed.

vLLM on CPU with its multiprocessing executor (``VLLM_ENABLE_V1_MULTIPROCESSING=1``: an
OpenAI server, as ``bench.pd_servers`` and ``bench.cluster_vs_vllm`` start it) passes messages
through Python ``multiprocessing.shared_memory`` segments, files named ``psm_*`` in ``/dev/shm``
(160-240 MiB each). vLLM unlinks them on a clean shutdown; a process group stopped with SIGKILL
leaves them, and a long-lived box accumulates them. The usage:

    before = psm_names()               # before the server starts
    ...                                # SIGTERM, then SIGKILL of its process group
    wait_group_exit(pgid)
    remove_leaked(before)              # psm_* new since ``before`` and mapped by no live process

A segment still mapped by a live process (another vLLM on the box, or one of this group that
has not died yet) is left alone and reported. Mappings are read from ``/proc/<pid>/maps`` of
the processes this user can read; ``/dev/shm`` is sticky, so what another user owns cannot be
removed anyway (a failed unlink is reported, not raised). A segment created by another server
between its ``shm_open`` and its ``mmap`` (microseconds) could be taken for a leak.

kvnotes' own vLLM decode engine (:mod:`decode_workers.vllm_engine`) runs the engine core in
its actor's process with the uniprocess executor (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so it
creates no such segments and has no stop path that needs this.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "psm_"          # multiprocessing.shared_memory's name prefix on POSIX


@dataclass(frozen=True)
class ShmSweep:
    """What :func:`remove_leaked` did (names are file names inside the shm dir)."""
    removed: tuple[str, ...]        # unlinked: new since the snapshot and mapped by no live process
    removed_bytes: int              # their sizes summed (bytes)
    mapped: tuple[str, ...]         # new since the snapshot but mapped by a live process: kept
    failed: tuple[str, ...] = ()    # unlink refused (e.g. owned by another user): kept


def psm_names(shm_dir: Path | str = SHM_DIR) -> frozenset[str]:
    """The ``psm_*`` file names in ``shm_dir`` now (empty when the dir does not exist)."""
    try:
        return frozenset(e.name for e in os.scandir(shm_dir) if e.name.startswith(PREFIX) and e.is_file())
    except FileNotFoundError:
        return frozenset()


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def mapped_paths(paths: set[str]) -> set[str]:
    """The members of ``paths`` (absolute, real) that some live process this user can read maps."""
    hit: set[str] = set()
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                for line in f:
                    parts = line.rstrip("\n").split(maxsplit=5)
                    if len(parts) == 6:
                        path = parts[5].removesuffix(" (deleted)")
                        if path in paths:
                            hit.add(path)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue        # gone meanwhile, or another user's
    return hit


def _group_alive(pgid: int) -> bool:
    """True while a process of group ``pgid`` is alive (zombies excluded: they map nothing)."""
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
                rest = f.read().rsplit(")", 1)[1].split()      # after "pid (comm)": state ppid pgrp ...
        except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError):
            continue
        if len(rest) > 2 and rest[0] not in ("Z", "X") and int(rest[2]) == pgid:
            return True
    return False


def wait_group_exit(pgid: int, timeout_s: float = 10.0) -> bool:
    """Wait (polling ``/proc``, at most ``timeout_s``) until no live process is left in process
    group ``pgid``, e.g. after ``os.killpg(pgid, SIGKILL)``; False if one is still alive."""
    deadline = time.monotonic() + timeout_s
    while _group_alive(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def remove_leaked(before: frozenset[str], shm_dir: Path | str = SHM_DIR, owner: str = "vLLM") -> ShmSweep:
    """Unlink the ``psm_*`` files of ``shm_dir`` that are not in ``before`` and that no live
    process maps; log what was removed (count, bytes) and what was kept (``owner`` names whose
    leak it is, in the log line)."""
    shm_dir = Path(shm_dir)
    new = sorted(psm_names(shm_dir) - before)
    if not new:
        return ShmSweep((), 0, ())
    real = {n: os.path.realpath(shm_dir / n) for n in new}
    busy = mapped_paths(set(real.values()))
    removed, failed, mapped, nbytes = [], [], [], 0
    for n in new:
        if real[n] in busy:
            mapped.append(n)
            continue
        try:
            size = os.stat(shm_dir / n).st_size
            os.unlink(shm_dir / n)
        except FileNotFoundError:
            continue            # its owner unlinked it meanwhile
        except OSError as exc:
            log.warning("%s shared memory %s not removed: %s", owner, shm_dir / n, exc)
            failed.append(n)
            continue
        removed.append(n)
        nbytes += size
    if removed:
        log.warning("removed %d leaked %s shared-memory segment(s) from %s (%d bytes, %.1f MiB): %s", len(removed),
                    owner, shm_dir, nbytes, nbytes / 2**20, ", ".join(removed))
    if mapped:
        log.warning("kept %d new %s segment(s) in %s still mapped by a live process: %s", len(mapped), owner,
                    shm_dir, ", ".join(mapped))
    return ShmSweep(tuple(removed), nbytes, tuple(mapped), tuple(failed))
