"""kvtransport.tier: the KV tier, where computed KV waits to be reused by later requests.

Who calls it: the prefill worker (``prefill_workers.tier_reads`` looks chunks up by key,
``prefill_workers.actor`` builds the :class:`~kvtransport.tier.lmcache_store.LMCacheStore`), the
control plane for the tier key (``cluster.control.ray_backends``) and the ``kvnotes tier-server``
command (``cluster.operator.cli``). What crosses it: a ``ChunkKey`` (model, dtype, RoPE, token ids,
tenant salt, canonical position) and the chunk's dense KV (``kvruntime.kv.KVCache``) in and out;
nothing else. What it calls: LMCache (imported lazily, CPU parts only) and, for ``lm://``, the
tier server over TCP (TLS by config) after a challenge-response on the tier key. It never imports
``kvtransport.transfer``: the tier stores LMCache memory objects, not transfer blocks.

- ``store``: ``ChunkKey`` and ``key_for`` (from ``kvruntime.messages.keys``) and the ``KVStore``
  interface (contains / put / get / pin / unpin / evict, batched defaults, stats).
- ``lmcache_store``: ``LMCacheStore``: local CPU, local disk, ``fs://`` persistence, ``lm://``
  remote; 256-token pieces with the tail piece stored; configured by the cluster config's ``tier``
  section as it is (``kvruntime.config.tier.TierConfig``, bytes), the ``lm://`` key beside it.
- ``lmcache_connector``: copies between our dense KV layout and LMCache memory objects.
- ``lmcache_remote``: the ``lm://`` tier bounded by timeouts, counted when down, reconnecting, probed.
- ``lmcache_env``: LMCache's process-wide settings (telemetry off) and the globals it touches.
- ``server``: start/stop the ``lm://`` tier server by PID (LMCache's, authenticated, LRU;
  ``python -m kvtransport.tier.server``); ``auth``: its tier-key challenge-response; ``lru``:
  what it holds, and its metrics; ``tls``: TLS around LMCache for ``lm://`` (a loopback tunnel per
  store, a terminator in the server; ``tier_remote_tls_*``).
"""
