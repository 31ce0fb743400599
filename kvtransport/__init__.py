"""kvtransport: the KV block format (header + payload, one codec), the KV tier (LMCache
behind a small store interface) and the transfer between prefill and decode workers.

The KV tier (prefill workers put and get whole chunks; LMCache is imported lazily, CPU parts only):
- ``store``: ``ChunkKey`` (model, dtype, RoPE, token ids, tenant salt, canonical position) and
  the ``KVStore`` interface (contains / put / get / pin / unpin / evict, batched defaults, stats).
- ``lmcache_store``: ``LMCacheStore`` + ``TierConfig``: local CPU, local disk, ``fs://``
  persistence, ``lm://`` remote; 256-token pieces with the tail piece stored.
- ``lmcache_connector``: copies between our dense KV layout and LMCache memory objects.
- ``lmcache_remote``: the ``lm://`` tier bounded by timeouts, counted when down, reconnecting, probed.
- ``lmcache_env``: LMCache's process-wide settings (telemetry off) and the globals it touches.
- ``tier_server``: start/stop the ``lm://`` tier server by PID (LMCache's, authenticated, LRU);
  ``tier_auth``: its tier-key challenge-response; ``tier_lru``: what it holds, and its metrics.

The transfer (prefill worker -> decode worker, one block per request):
- ``blocks``: ``KVBlock`` (header + one contiguous payload), the one codec (zero-copy encode and
  decode, CRC-32C via libcrc32c; ``encode_block(into=transport.lease)`` encodes into registered memory).
- ``transport``: the ``KVTransport`` seam, transfer states and errors, the bounded ``Inbox``
  (only router-granted transfers with their credential when ``require_grant``; duplicate ids
  refused, expiry counted) and the ``BufferPool`` arena receivers lease from.
- ``grpc_transport`` + ``grpc_codec`` + ``proto/``: the portable push over gRPC (decode serves).
- ``nixl_transport``: NIXL/UCX, registered pool, receiver READs, completion by notification;
  agent metadata passes through the caller (``metadata()`` / ``add_peer``). Imports NIXL lazily.
  ``send_kv`` (``nixl_send``) announces the payload piece by piece while the receiver READs,
  CRC last: without a copy when the KV already lives in the pool (the prefill built it there,
  ``Sender.alloc``), else copied (and cast to the wire dtype) in the same pass;
  ``nixl_wire`` holds the notifications, ``nixl_read`` the receiving READ loop.
- ``endpoints``: the chosen transport (``kv_transport: auto | nixl | grpc``) at both ends: the
  decode side's ``Receiver`` (one granted inbox fed by NIXL and gRPC, bound to the node's address)
  and the prefill side's ``Sender`` (engine dtype on the wire, credential in the header, fallback
  to gRPC reported, ``alloc``: registered memory to build the shipped KV in).
"""
