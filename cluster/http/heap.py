"""Giving the memory of large request bodies back to the system (glibc's malloc; elsewhere these
are no-ops).

A router replica reads bodies of up to ``max_body_bytes`` (8 MiB), parses them into strings of
as much again, and may tokenise a text of up to ``max_text_chars``. Measured in a replica
(tests/test_request_pricing.py), glibc kept that memory: its mmap threshold rises to the size of
the largest block freed (so later large blocks come from the heap, where fragmentation keeps
them), and every thread that allocates (event loop, anyio worker threads, the tokenizer's
Rayon pool) gets an arena of its own. :func:`configure` fixes the threshold at 128 KiB and caps
the arenas at 2, once per process; :func:`trim` returns free pages after a large request.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

log = logging.getLogger(__name__)

LARGE_BODY_BYTES = 256 << 10       # requests whose body is at least this big are followed by trim()
_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8     # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 128 << 10         # blocks this large are mmapped (and unmapped when freed), always
ARENA_MAX = 2


def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _libc()


def configure() -> bool:
    """Fix glibc's mmap threshold and cap its arenas for this process; False where not glibc."""
    if _LIBC is None:
        return False
    ok = _LIBC.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and _LIBC.mallopt(_M_ARENA_MAX, ARENA_MAX) == 1
    if not ok:
        log.warning("mallopt refused the mmap threshold / arena cap: large requests may leave memory behind")
    return ok


_TRIMMING = threading.Lock()


def trim() -> None:
    """Return free heap pages of every arena to the system (a few milliseconds; call it off the
    event loop). A trim already running makes this one a no-op."""
    if _LIBC is not None and _TRIMMING.acquire(blocking=False):
        try:
            _LIBC.malloc_trim(0)
        finally:
            _TRIMMING.release()
