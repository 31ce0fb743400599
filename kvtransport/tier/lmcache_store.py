"""The KV tier on LMCache 0.5.6: :class:`LMCacheStore` implements :class:`KVStore` with an
``LMCacheEngine`` (local CPU memory, optional local disk, optional ``fs://`` persistence,
optional ``lm://`` remote served by ``lmcache_server``; see ``kvtransport.tier.server``).

How a chunk maps onto LMCache:
- LMCache is given the chunk's real token ids and our dense KV (``kvcaches=``, see
  ``lmcache_connector``). It cuts them into ``chunk_size`` (256) pieces with a chained prefix
  hash (SHA-256 based and process-independent: ``StableTokenDatabase``). ``save_unfull_chunk``
  is on, so the tail piece is stored too: a 300-token chunk is one 256-token piece plus a
  44-token piece, and ``get`` only returns when *every* piece is found (else a counted miss).
- Every LMCache key carries the tag ``kvn=<ChunkKey.namespace>`` (128-bit hash of model, dtype,
  RoPE, canonical position, tenant salt and exact|approximate recipe). LMCache compares tags
  exactly, so two tenants (or models, positions, recipes) never share an entry, even for
  identical token ids; its chained piece hash commits to the tokens. An entry therefore also
  serves any prefix of its tokens that ends on a 256-token piece boundary (``get`` of that
  prefix's key hits): the plain-prompt prefix reuse of the router relies on it.
- Pins are LMCache's (local CPU and disk); its pin timeout is set to "never" (default 300 s).
Tiers, fastest first (LMCache's lookup order): cpu -> disk -> fs -> remote. The local CPU buffer
(``cpu_bytes``) always exists: it stages every transfer even when ``local_cpu`` is False.
Persistence: ``fs://`` survives restarts; the ``lm://`` server survives client restarts (not its
own: it holds everything in memory, least recently used evicted beyond its capacity, no delete);
``local_disk`` keeps its index in memory, so it does *not* persist.
Thread safety: one lock serialises all operations of a store.
"""
from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from kvruntime.kv import KVCache
from kvruntime.staging import to_host
from kvruntime.config.tier import TierConfig
from kvtransport.tier.store import (KV_DTYPES, ChunkKey, KVStore, StoreStats, TierWriteError, check_kv, check_model_id,
                              key_positions, rope_fingerprint)

log = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TIER_NAMES = {"LocalCPUBackend": "cpu", "LocalDiskBackend": "disk", "RemoteBackend-fs": "fs",
               "RemoteBackend": "remote"}
_TAG = "lmcache.tag.kvn"
_PIN_FOREVER_S = 2**31 - 1   # LMCache force-unpins after pin_timeout_sec (default 300 s); ours are explicit


class LMCacheStore(KVStore):
    """:class:`KVStore` on one ``LMCacheEngine`` for one model's KV shape and dtype.

    Construction costs ~1 s (LMCache allocates its CPU buffer and starts its threads) plus a
    bounded remote probe. Operation costs: ``put``/``get`` copy the chunk once between our layout
    and LMCache's (plus one copy per lower tier written or read); ``contains`` copies nothing;
    remote operations are bounded by ``remote_timeout_s``.
    """

    def __init__(self, model_id: str, dtype: str, layers: int, kv_heads: int, head_dim: int,
                 config: TierConfig = TierConfig(), *, rope: str | None = None, remote_key: bytes | None = None):
        """``config``: the cluster config's ``tier`` section (bytes, seconds); ``remote_key``: the
        ``lm://`` tier's 32-byte key (``kvtransport.tier.auth.tier_key`` of the cluster secret),
        required with ``config.remote_url`` (the tier server refuses anonymous clients)."""
        if dtype not in KV_DTYPES:
            raise ValueError(f"dtype must be one of {KV_DTYPES}, got {dtype!r}")
        if min(layers, kv_heads, head_dim) <= 0:
            raise ValueError(f"layers, kv_heads, head_dim must be > 0, got {layers}, {kv_heads}, {head_dim}")
        if config.remote_url is not None:
            from kvtransport.tier.auth import check_key
            if remote_key is None:
                raise ValueError("tier_remote_url needs the tier key: the tier server refuses anonymous clients "
                                 "(kvtransport.tier.auth.tier_key of the cluster secret)")
            check_key(remote_key)
            if config.remote_tls is not None:
                from kvtransport.tier.tls import checked_files
                checked_files(config.remote_tls, server=False)   # before any engine: unreadable, or a loose key
        from kvtransport.tier import lmcache_env
        lmcache_env.prepare()
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata

        from kvtransport.tier.lmcache_connector import StableTokenDatabase, make_connector

        check_model_id(model_id)
        self.model_id, self.dtype, self.rope = model_id, dtype, rope
        self.shape = (layers, kv_heads, head_dim)
        self.config = config
        self._torch_dtype = _TORCH_DTYPES[dtype]
        self._connector = make_connector(config.connector, layers, kv_heads, head_dim)
        self._instance = f"kvnotes-{model_id}-{uuid.uuid4().hex[:8]}"
        from kvruntime.private_files import private_dir
        for d in (config.persist_dir, config.disk_path):    # tenants' KV: a 0700 directory (warned if looser)
            if d:
                private_dir(d)
        plugins = ["fs"] if config.persist_dir else None
        extra = {"remote_storage_plugin.fs.base_path": str(Path(config.persist_dir).resolve())} \
            if config.persist_dir else None
        cfg = LMCacheEngineConfig.from_defaults(
            chunk_size=config.chunk_size, local_cpu=config.local_cpu, max_local_cpu_size=config.cpu_bytes / 2**30,
            local_disk=config.disk_path and str(Path(config.disk_path).resolve()) + "/",   # LMCache sizes in GB
            max_local_disk_size=config.disk_bytes / 2**30 if config.disk_path else 0.0, remote_url=None,
            save_unfull_chunk=True,
            blocking_timeout_secs=max(1, math.ceil(config.remote_timeout_s)), pin_timeout_sec=_PIN_FOREVER_S,
            remote_storage_plugins=plugins, extra_config=extra, lmcache_instance_id=self._instance)
        md = LMCacheMetadata(model_name=model_id, world_size=1, local_world_size=1, worker_id=0,
                             local_worker_id=0, kv_dtype=self._torch_dtype,
                             kv_shape=(layers, 2, config.chunk_size, kv_heads, head_dim),
                             chunk_size=config.chunk_size)
        with lmcache_env.contained_globals():
            self._engine = LMCacheEngineBuilder.get_or_create(self._instance, cfg, md, self._connector, None, None)
            self._engine.token_database = StableTokenDatabase(cfg, md)   # same keys in every process
            self._engine.post_init()
        from lmcache.v1.pin_monitor import PinMonitor   # one per process: the first engine's config wins
        pin_timeout = getattr(PinMonitor.GetOrCreate(cfg, md), "_pin_timeout_sec", None)
        if pin_timeout != _PIN_FOREVER_S:
            log.warning("LMCache in this process force-unpins after %s s (set by an earlier LMCache "
                        "engine): pins of this store expire then", pin_timeout)
        self._lock = threading.RLock()              # serialises operations
        self._count_lock = threading.Lock()         # guards _counts (stats may be read mid-operation)
        self._counts: Counter[str] = Counter()
        self._warned: set[str] = set()
        self._remote = None
        if config.remote_url:
            from kvtransport.tier.lmcache_remote import RemoteTier
            cfg.remote_url = config.remote_url    # read by LMCache's RemoteBackend, built by RemoteTier
            try:
                self._remote = RemoteTier(config.remote_url, self._engine, config.remote_timeout_s,
                                          config.remote_retry_s, remote_key, self._lock, config.remote_probe_s,
                                          config.remote_tls)
            except BaseException:
                LMCacheEngineBuilder.destroy(self._instance)
                raise
        self._closed = False

    @classmethod
    def for_engine(cls, engine, config: TierConfig = TierConfig(), *, remote_key: bytes | None = None) -> "LMCacheStore":
        """A store for ``engine``'s weights (a ``kvruntime.engine.ReferenceEngine``; its
        ``model_id`` carries the checkpoint's content hash) and KV dtype."""
        return cls(engine.model_id, engine.dtype_name, engine.num_layers, engine.kv_heads, engine.head_dim,
                   config, rope=rope_fingerprint(engine.rope), remote_key=remote_key)

    # ---- KVStore ------------------------------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        with self._lock:
            self._check_key(key)
            self._before()
            n = self._engine.lookup(tokens=list(key.token_ids), request_configs=self._tags(key))
            remote_lost = self._after()
            self._bump("lookups")
            if n == key.num_tokens:
                self._bump("lookup_hits")
                return True
            self._miss("lookup_misses", "remote_down" if remote_lost else ("partial" if n else "absent"))
            return False

    def put(self, key: ChunkKey, kv: KVCache) -> int:
        with self._lock:
            self._check_key(key)
            check_kv(key, kv)
            want = (self.shape[0], 2, self.shape[1], key.num_tokens, self.shape[2])
            if tuple(kv.data.shape) != want or kv.data.dtype != self._torch_dtype:
                raise ValueError(f"KV {tuple(kv.data.shape)} {kv.data.dtype} does not match the store's "
                                 f"{want} {self._torch_dtype}")
            self._before()
            # a GPU engine's KV goes to a host connector through pinned memory (kvruntime.staging)
            data = to_host(kv.data) if self._connector.device.type == "cpu" else kv.data.to(self._connector.device)
            self._engine.store(list(key.token_ids), kvcaches=data, request_configs=self._tags(key))
            held = self._confirm(self._pieces(key))
            self._after()
            if self._remote is not None and "remote" not in held:
                held["remote"] = False     # configured but down: the put skipped it
            for tier, ok in held.items():
                if not ok:
                    self._bump(f"put_fail:{tier}")
                    self._warn_once(f"put:{tier}", "tier %s did not take a chunk (%d tokens): it is "
                                    "served from the other tiers or recomputed", tier, key.num_tokens)
            if not any(held.values()):
                self._remove([k for _, _, k in self._pieces(key)])     # free the pieces that did land
                raise TierWriteError(f"no tier holds the chunk ({key.num_tokens} tokens, {kv.nbytes} bytes) "
                                     f"after put; tiers tried: {sorted(held)}. Is tier_cpu_bytes too small?")
            self._bump("puts")
            self._bump("put_bytes", kv.nbytes)
            return kv.nbytes

    def get(self, key: ChunkKey, out: torch.Tensor | None = None) -> KVCache | None:
        with self._lock:
            self._check_key(key)
            layers, heads, dim = self.shape
            want = (layers, 2, heads, key.num_tokens, dim)
            if out is None:
                out = torch.empty(want, dtype=self._torch_dtype, device=self._connector.device)
            elif tuple(out.shape) != want or out.dtype != self._torch_dtype or out.device != self._connector.device:
                raise ValueError(f"out {tuple(out.shape)} {out.dtype} {out.device} must be {want} "
                                 f"{self._torch_dtype} {self._connector.device}")
            self._before()
            pieces = self._pieces(key)
            tier = self._holding_tier(pieces)
            mask = self._engine.retrieve(list(key.token_ids), kvcaches=out, request_configs=self._tags(key))
            got = int(mask.sum())
            remote_lost = self._after()
            self._bump("gets")
            if got != key.num_tokens:
                self._miss("misses", "remote_down" if remote_lost else ("partial" if got else "absent"))
                return None
            tier = tier or ("remote" if self._remote is not None else "mixed")
            self._bump("hits")
            self._bump(f"hit:{tier}")
            self._bump("get_bytes", out.numel() * out.element_size())
            return KVCache(out, key_positions(key, out.device),
                           torch.tensor(key.token_ids, dtype=torch.long, device=out.device))

    def pin(self, key: ChunkKey) -> bool:
        with self._lock:
            self._check_key(key)
            return self._each_local(key, "pin")

    def unpin(self, key: ChunkKey) -> bool:
        with self._lock:
            self._check_key(key)
            return self._each_local(key, "unpin")

    def evict(self, key: ChunkKey) -> bool:
        with self._lock:
            self._check_key(key)
            removed = self._remove([k for _, _, k in self._pieces(key)])
            if self._remote is not None:
                self._bump("remote_evict_unsupported")
                self._warn_once("evict:remote", "the lm:// server has no delete: evicted chunks stay "
                                "there until its LRU drops them or it restarts (%s)", self.config.remote_url)
            self._bump("evictions", int(removed))
            return removed

    @property
    def stats(self) -> StoreStats:
        with self._count_lock:
            c = Counter(self._counts)
        pick = lambda prefix: {k.split(":", 1)[1]: v for k, v in c.items() if k.startswith(prefix)}  # noqa: E731
        return StoreStats(
            lookups=c["lookups"], lookup_hits=c["lookup_hits"], gets=c["gets"], hits=c["hits"],
            hits_by_tier=pick("hit:"), misses=pick("misses:"), lookup_misses=pick("lookup_misses:"),
            puts=c["puts"], put_bytes=c["put_bytes"], get_bytes=c["get_bytes"],
            put_tier_failures=pick("put_fail:"),
            remote_errors=self._remote.errors if self._remote else 0,
            remote_reconnects=self._remote.reconnects if self._remote else 0,
            remote_auth_refusals=self._remote.auth_refusals if self._remote else 0,
            remote_tls_connections=self._remote.tls_counts.connections if self._remote else 0,
            remote_tls_handshake_failures=self._remote.tls_counts.handshake_failures if self._remote else 0,
            remote_last_error=self._remote.last_error if self._remote else "",
            remote_up=bool(self._remote and self._remote.up), evictions=c["evictions"],
            remote_evict_unsupported=c["remote_evict_unsupported"])

    def occupancy(self) -> dict[str, int]:
        """Bytes held now per local tier: ``cpu`` (LMCache's hot cache) and ``disk`` (its own size
        accounting); shared tiers (``fs``, ``remote``) are not sized from one worker."""
        out: dict[str, int] = {}
        for name, be in list(self._engine.storage_manager.storage_backends.items()):
            tier = _TIER_NAMES.get(name, name)
            if hasattr(be, "hot_cache") and hasattr(be, "cpu_lock"):
                with be.cpu_lock:
                    out[tier] = sum(int(m.get_size()) for m in be.hot_cache.values())
            elif hasattr(be, "current_cache_size"):
                out[tier] = int(be.current_cache_size)
        return out

    @property
    def tiers(self) -> list[str]:
        """Configured tiers in lookup order (a down remote included)."""
        names = [_TIER_NAMES.get(n, n) for n in self._engine.storage_manager.storage_backends
                 if not (n == "LocalCPUBackend" and not self.config.local_cpu)]
        if self._remote is not None and "remote" not in names:
            names.append("remote")
        return names

    def close(self) -> None:
        """Destroy the LMCache engine (threads, buffers) and close the remote socket."""
        if self._remote is not None:
            self._remote.stop_probe()      # before the lock: the probe thread may be waiting for it
        with self._lock:
            if self._closed:
                return
            self._closed = True
            from lmcache.v1.cache_engine import LMCacheEngineBuilder
            if self._remote is not None:
                self._remote.close()
                self._engine.storage_manager.storage_backends.pop("RemoteBackend", None)
            LMCacheEngineBuilder.destroy(self._instance)

    # ---- internals ----------------------------------------------------------------------------
    def _check_key(self, key: ChunkKey) -> None:
        if self._closed:
            raise RuntimeError("store is closed")
        if not isinstance(key, ChunkKey):
            raise TypeError(f"expected a ChunkKey, got {type(key).__name__}")
        if key.model_id != self.model_id or key.dtype != self.dtype:
            raise ValueError(f"key is for {key.model_id}/{key.dtype}; this store holds {self.model_id}/{self.dtype}")
        if self.rope is not None and key.rope != self.rope:
            raise ValueError(f"key RoPE fingerprint {key.rope} != the store's {self.rope}")

    @staticmethod
    def _tags(key: ChunkKey) -> dict[str, str]:
        return {_TAG: key.namespace}

    def _pieces(self, key: ChunkKey) -> list[tuple[int, int, Any]]:
        """LMCache's (start, end, CacheEngineKey) pieces of the chunk, tail piece included."""
        return list(self._engine.token_database.process_tokens(tokens=list(key.token_ids),
                                                               request_configs=self._tags(key)))

    def _before(self) -> None:
        if self._remote is not None:
            self._remote.before_op()

    def _after(self) -> bool:
        return self._remote.after_op() if self._remote is not None else False

    def _active(self) -> list[tuple[str, Any]]:
        sm = self._engine.storage_manager
        return [(n, be) for n, be in sm.get_active_storage_backends()
                if not (n == "LocalCPUBackend" and not self.config.local_cpu)]

    def _confirm(self, pieces: list[tuple[int, int, Any]]) -> dict[str, bool]:
        """Wait (bounded) for async tier writes of ``pieces``; report which tiers hold them all.
        For lm:// the check is an EXIST on the same socket, answered after the server stored the PUT."""
        keys = [k for _, _, k in pieces]
        deadline = time.monotonic() + self.config.confirm_timeout_s
        held: dict[str, bool] = {}
        for name, be in self._active():
            while any(be.exists_in_put_tasks(k) for k in keys) and time.monotonic() < deadline:
                time.sleep(0.002)
            held[_TIER_NAMES.get(name, name)] = all(be.contains(k) for k in keys)
        return held

    def _holding_tier(self, pieces: list[tuple[int, int, Any]]) -> str | None:
        """First local/fs tier (lookup order) holding every piece; None if none does. Skips the
        lm:// remote (its answer would cost a round trip)."""
        keys = [k for _, _, k in pieces]
        for name, be in self._active():
            if name != "RemoteBackend" and all(be.contains(k) for k in keys):
                return _TIER_NAMES.get(name, name)
        return None

    def _remove(self, keys: list[Any]) -> bool:
        """Remove LMCache pieces from every tier that can delete (not lm://). True if any held one."""
        removed = False
        for name, be in list(self._engine.storage_manager.storage_backends.items()):
            if name == "RemoteBackend":
                continue
            for k in keys:
                if name == "LocalDiskBackend":
                    removed |= _remove_from_disk(be, k)
                elif be.contains(k):
                    removed |= bool(be.remove(k))
        return removed

    def _each_local(self, key: ChunkKey, op: str) -> bool:
        keys = [k for _, _, k in self._pieces(key)]
        done = False
        for name, be in self._active():
            if name in ("LocalCPUBackend", "LocalDiskBackend") and all(be.contains(k) for k in keys):
                done |= all(getattr(be, op)(k) for k in keys)
        return done

    def _bump(self, name: str, n: int = 1) -> None:
        with self._count_lock:
            self._counts[name] += n

    def _miss(self, counter: str, reason: str) -> None:
        self._bump(f"{counter}:{reason}")
        if reason == "partial":
            self._warn_once("partial", "a chunk was only partly in the tiers (LMCache evicted some of "
                            "its pieces): counted as a miss, the caller recomputes")

    def _warn_once(self, what: str, msg: str, *args) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(msg, *args)


def _remove_from_disk(be: Any, key: Any) -> bool:
    """``LocalDiskBackend.remove`` plus the capacity accounting LMCache 0.5.6 forgets on a forced
    remove (``current_cache_size`` is only lowered on its own evictions): without this, a disk tier
    whose entries were evicted by us stays "full" and refuses every later put."""
    with be.disk_lock:
        meta = be.dict.get(key)
    if meta is None or not be.remove(key):
        return False
    with be.disk_lock:
        be.current_cache_size = max(0, be.current_cache_size - meta.size)
    return True
