"""What we plug into LMCache: our connector between the dense :class:`~kvruntime.kv.KVCache`
layout and LMCache's memory objects (LMCache calls it a "GPU connector"; ours copies with plain
torch, on any device), and a token database whose hash chain is the same in every process.

Layouts (T = tokens of one LMCache chunk, at most ``chunk_size``):
- ours:    ``kv.data``  ``[layers, 2, kv_heads, tokens, head_dim]``
- LMCache: ``MemoryObj.tensor`` ``[2, layers, T, kv_heads * head_dim]`` (``MemoryFormat.KV_2LTD``)

LMCache hands the connector ``(memory_obj, start, end)`` per chunk plus the keyword arguments
given to ``LMCacheEngine.store/retrieve``; we pass the dense tensor as ``kvcaches=``.
Cost per chunk: one strided copy of ``2 * layers * T * kv_heads * head_dim`` elements.
Importing this module imports LMCache (CPU parts only).
"""
from __future__ import annotations

import torch

from kvtransport.tier import lmcache_env

lmcache_env.prepare()

import hashlib  # noqa: E402

from lmcache.v1.gpu_connector import GPUConnectorInterface  # noqa: E402  (after env set-up)
from lmcache.v1.memory_management import MemoryFormat, MemoryObj  # noqa: E402
from lmcache.v1.token_database import ChunkedTokenDatabase  # noqa: E402


def dense_to_lmcache(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy ``src`` [layers, 2, kv_heads, T, head_dim] into ``dst`` [2, layers, T, kv_heads*head_dim]."""
    layers, two, heads, t, dim = src.shape
    dst.view(2, layers, t, heads, dim).copy_(src.permute(1, 0, 3, 2, 4))


def lmcache_to_dense(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy ``src`` [2, layers, T, kv_heads*head_dim] into ``dst`` [layers, 2, kv_heads, T, head_dim]."""
    layers, two, heads, t, dim = dst.shape
    dst.copy_(src.view(2, layers, t, heads, dim).permute(1, 0, 3, 2, 4))


class DenseKVConnector(GPUConnectorInterface):
    """Copies between a dense ``kvcaches`` tensor (on ``device``) and LMCache CPU memory objects.

    On CUDA the device-to-host copies are followed by a synchronise so LMCache never reads a
    buffer that is still being written. Not thread-safe per call; LMCacheStore serialises calls.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, device: torch.device | str = "cpu"):
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.device = torch.device(device)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.layers, num_tokens, self.kv_heads * self.head_dim])

    def _dense(self, kwargs: dict) -> torch.Tensor:
        kv = kwargs.get("kvcaches")
        if not isinstance(kv, torch.Tensor) or kv.dim() != 5:
            raise ValueError("DenseKVConnector needs kvcaches=<tensor [layers, 2, kv_heads, tokens, head_dim]>")
        want = (self.layers, 2, self.kv_heads, self.head_dim)
        got = (kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[4])
        if got != want:
            raise ValueError(f"kvcaches shape {tuple(kv.shape)} does not match the store's "
                             f"[layers={self.layers}, 2, kv_heads={self.kv_heads}, tokens, head_dim={self.head_dim}]")
        return kv

    def _obj_tensor(self, memory_obj: MemoryObj, tokens: int) -> torch.Tensor:
        t = memory_obj.tensor
        if t is None or memory_obj.get_memory_format() != MemoryFormat.KV_2LTD:
            raise ValueError(f"expected a KV_2LTD memory object, got {memory_obj.get_memory_format()}")
        if tuple(t.shape) != tuple(self.get_shape(tokens)):
            raise ValueError(f"memory object shape {tuple(t.shape)} != {tuple(self.get_shape(tokens))}")
        return t

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        kv = self._dense(kwargs)
        dense_to_lmcache(kv[:, :, :, start:end], self._obj_tensor(memory_obj, end - start))
        self._sync()

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        kv = self._dense(kwargs)
        lmcache_to_dense(self._obj_tensor(memory_obj, end - start), kv[:, :, :, start:end])
        self._sync()

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for obj, s, e in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, s, e, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs) -> None:
        for obj, s, e in zip(memory_objs or [], starts or [], ends or [], strict=True):
            self.to_gpu(obj, s, e, **kwargs)


def make_connector(kind: str, layers: int, kv_heads: int, head_dim: int) -> DenseKVConnector:
    """``"cpu"``: dense KV in host memory. ``"cuda"``: dense KV on the current CUDA device.

    The CUDA path is the same torch copies with a synchronise; it needs LMCache's CUDA extras
    (cupy-cuda13x, cuda-python, nvtx: not installed by scripts/dev.sh) and is untested here
    (no GPU in CI). Selecting it without CUDA raises ``RuntimeError``.
    """
    if kind == "cpu":
        return DenseKVConnector(layers, kv_heads, head_dim, "cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("connector='cuda' selected but CUDA is not available on this machine; "
                               "use connector='cpu'")
        return DenseKVConnector(layers, kv_heads, head_dim, f"cuda:{torch.cuda.current_device()}")
    raise ValueError(f"connector must be 'cpu' or 'cuda', got {kind!r}")


def _sha256_63(obj) -> int:
    """63-bit SHA-256 of ``repr(obj)``: for LMCache's (prefix_hash, token_tuple, extras) tuples
    of ints, the same in every process and every Python build. Cost: ~10 us per 256 tokens."""
    return int.from_bytes(hashlib.sha256(repr(obj).encode()).digest()[:8], "big") >> 1


class StableTokenDatabase(ChunkedTokenDatabase):
    """LMCache's chunking (``chunk_size`` pieces, chained prefix hash) with a chain that does not
    depend on the process: it starts from 0 and hashes with SHA-256. Stock LMCache uses Python's
    ``hash`` and, when vLLM is importable, vLLM's ``NONE_HASH``, which is random per process
    unless ``PYTHONHASHSEED`` is set: another process (a fresh worker, a restart reading the
    ``fs://`` tier) would then compute other keys and miss everything."""

    def __init__(self, config, metadata):
        super().__init__(config, metadata)
        self.hash_func = _sha256_63

    def _get_init_hash(self) -> int:
        return 0
