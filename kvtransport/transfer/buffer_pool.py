"""The receivers' memory: one :class:`BufferPool` arena (allocated once, optionally on
transparent huge pages, so its pages stay warm) handed out as leases that end when the last
tensor made from a block is dropped. gRPC receives a block's payload into a lease; NIXL
registers the whole arena with its agent (READs land in it; ``Sender.alloc`` builds KV in it).
"""
from __future__ import annotations

import logging
import mmap
import threading
import weakref

import numpy as np
import torch

log = logging.getLogger(__name__)


def _arena(nbytes: int, huge_pages: bool) -> torch.Tensor:
    """``nbytes`` of anonymous memory as a uint8 tensor; with ``huge_pages``, advised
    ``MADV_HUGEPAGE`` (transparent 2 MiB pages where the kernel allows them: fewer page faults,
    TLB misses and page pins for cma/RDMA). Falls back to ``torch.empty`` where madvise is absent."""
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError as exc:  # THP disabled ("never") or unsupported: small pages, logged
            log.info("MADV_HUGEPAGE refused for a %d-byte pool: %s", nbytes, exc)
        return torch.frombuffer(mm, dtype=torch.uint8)     # the tensor keeps the mapping alive
    return torch.empty(nbytes, dtype=torch.uint8)


class BufferPool:
    """One arena of ``nbytes`` (a uint8 tensor, allocated once, so its pages stay warm) handed
    out as leases. :meth:`lease` returns a writable 1-D numpy view; the lease ends (the range is
    free again) when that array and everything made from it (memoryviews, ``torch.frombuffer``
    tensors, views of those) is garbage. Thread-safe; first fit over a sorted free list."""

    def __init__(self, nbytes: int, *, align: int = 4096, huge_pages: bool = True, prefault_bytes: int = 0):
        if nbytes <= 0 or align <= 0 or prefault_bytes < 0:
            raise ValueError("BufferPool needs nbytes > 0, align > 0 and prefault_bytes >= 0")
        self.arena = _arena(nbytes, huge_pages)                # [nbytes] raw bytes, CPU
        # the first ``prefault_bytes`` (where leases start: first fit) touched now, at start: a first
        # touch of fresh pages cost 0.72 s for 179 MB here (0.011 s warm), inside the first request
        # that used them (its KV build or its READ), issue 47
        self.arena[:min(prefault_bytes, nbytes)].zero_()
        self.nbytes, self.align = nbytes, align
        self._free: list[tuple[int, int]] = [(0, nbytes)]     # sorted (offset, length)
        self._lock = threading.Lock()
        self.leased_bytes = 0                                  # bytes currently leased

    @property
    def address(self) -> int:
        return self.arena.data_ptr()

    def lease(self, nbytes: int) -> np.ndarray | None:
        """A writable view of ``nbytes`` pooled bytes, or None when no free range fits."""
        size = max(self.align, -(-nbytes // self.align) * self.align)
        with self._lock:
            for i, (off, length) in enumerate(self._free):
                if length >= size:
                    if length == size:
                        del self._free[i]
                    else:
                        self._free[i] = (off + size, length - size)
                    self.leased_bytes += size
                    break
            else:
                return None
        view = self.arena[off:off + nbytes].numpy()
        weakref.finalize(view, self._release, off, size)
        return view

    def _release(self, off: int, size: int) -> None:
        with self._lock:
            self.leased_bytes -= size
            free = self._free
            i = 0
            while i < len(free) and free[i][0] < off:
                i += 1
            free.insert(i, (off, size))
            if i + 1 < len(free) and free[i][0] + free[i][1] == free[i + 1][0]:        # merge right
                free[i] = (off, size + free.pop(i + 1)[1])
            if i > 0 and free[i - 1][0] + free[i - 1][1] == free[i][0]:                 # merge left
                free[i - 1] = (free[i - 1][0], free[i - 1][1] + free.pop(i)[1])
