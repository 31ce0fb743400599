"""KV on its way off the device: chunk KV computed on a GPU goes to the tier (host memory, disk,
``lm://``) and the transport (gRPC / NIXL buffers in host memory) through pinned host memory.

A device-to-host copy into pageable memory is staged by the driver through its own pinned
buffer, one bounce copy per piece, synchronous; a copy into page-locked memory is one DMA at the
link's bandwidth (about 2x on PCIe hosts). :func:`to_host` allocates the destination from torch's
caching host allocator (``pin_memory=True``: freed blocks are reused, so pinning is paid once per
size) and casts on the device first when a wire dtype is asked for (fewer bytes cross the link).

CPU tensors take the plain path: no pinning (nothing to DMA), no copy when already contiguous
in the dtype. Pinning can fail (a locked-memory limit): then the copy goes to pageable memory,
is counted in :data:`counts` (``pageable_fallback``) and logged once.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter

import torch

log = logging.getLogger(__name__)
counts: Counter[str] = Counter()      # "cpu", "pinned", "pageable_fallback": tensors staged each way
_lock = threading.Lock()
_warned = False


def to_host(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` on the CPU in ``dtype`` (default: its own), contiguous. CUDA (any non-CPU device):
    cast there, copied into pinned host memory, the copy waited for. CPU: ``t`` itself when it
    already fits, else one cast/copy."""
    global _warned
    dtype = dtype or t.dtype
    if t.device.type == "cpu":
        _count("cpu")
        return t.to(dtype).contiguous()
    src = t.to(dtype) if t.dtype != dtype else t
    try:
        host = torch.empty(src.shape, dtype=dtype, pin_memory=True)
    except RuntimeError as exc:            # page-locked memory refused: pageable, counted
        _count("pageable_fallback")
        with _lock:
            if not _warned:
                _warned = True
                log.warning("pinned host memory unavailable (%s): KV leaves the GPU through pageable memory", exc)
        return src.to("cpu").contiguous()
    host.copy_(src, non_blocking=True)
    if src.device.type == "cuda":
        torch.cuda.current_stream(src.device).synchronize()
    _count("pinned")
    return host


def _count(path: str) -> None:
    with _lock:
        counts[path] += 1
