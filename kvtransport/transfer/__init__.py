"""kvtransport.transfer: the prefill -> decode transfer, one block per request.

Who calls it: the prefill worker sends with a :class:`~kvtransport.transfer.endpoints.Sender`,
the shipped :class:`~kvtransport.transfer.interface.KVSender` (``prefill_workers.actor`` / ``executor``); the decode worker receives on a
:class:`~kvtransport.transfer.endpoints.Receiver` and decodes blocks (``decode_workers.actor``,
``executor``, ``vllm_connector``); the launcher checks the transport options
(``cluster.operator.launcher``). What crosses it: a :class:`~kvtransport.transfer.blocks.KVBlock`
(header: transfer id, model, shape, dtype, positions, token ids, credential, CRC-32C; payload:
the dense KV) from sender to receiver; the router's ``TransferGrant`` (announced to the receiver's
inbox) and the receiver's ``KVEndpoint`` (travelling to senders) from ``kvruntime.messages.transfer``.
What it calls: gRPC and NIXL/UCX (imported lazily). It never imports ``kvtransport.tier``.

- ``blocks``: ``KVBlock`` (header + one contiguous payload), the one codec (zero-copy encode and
  decode, CRC-32C via libcrc32c; ``encode_block(into=...lease)`` encodes into registered memory).
  The wire format of this box only, so it lives here.
- ``interface``: the roles: ``KVSender`` (what the prefill executor ships with: ``send(to,
  transfer_id, model, kv)`` -> ``SendResult``), ``BlockSender`` (``send(address, block)``) and
  ``KVReceiver`` (``receive``), ``KVTransport`` (both block roles: gRPC and NIXL); transfer
  states, ``TransferError``, ``TransferReceipt``.
- ``inbox``: the bounded ``Inbox`` (only router-granted transfers with their credential when
  ``require_grant``; duplicate ids refused, expiry counted) and its ``InboxStats``.
- ``buffer_pool``: the ``BufferPool`` arena receivers lease from (warm, optionally huge pages).
- ``grpc_transport`` + ``grpc_codec`` + ``proto/``: the portable push over gRPC (decode serves);
  split by stage: ``grpc_config`` (its typed config), ``grpc_server`` (the receiving side:
  admit, read, verify), ``grpc_client`` (the sending side); ``grpc_transport`` joins both ends;
  ``same_host``: whether a peer is this host (same-host pushes may skip the checksum).
- ``nixl_transport``: NIXL/UCX, registered pool, receiver READs, completion by notification;
  agent metadata passes through the caller (``metadata()`` / ``add_peer``). Imports NIXL lazily.
  ``send_kv`` (``nixl_send``) announces the payload piece by piece while the receiver READs,
  CRC last: without a copy when the KV already lives in the pool (the prefill built it there,
  ``Sender.alloc``), else copied (and cast to the wire dtype) in the same pass;
  ``nixl_wire`` holds the notifications, ``nixl_read`` the receiving READ loop.
- ``endpoints``: the chosen transport (``kv_transport: auto | nixl | grpc``) at both ends: the
  decode side's ``Receiver`` (a ``KVReceiver``: one granted inbox fed by NIXL and gRPC, bound to
  the node's address) and the prefill side's ``Sender`` (a ``KVSender``: engine dtype on the wire,
  credential in the header, fallback to gRPC reported, ``alloc``: registered memory to build the
  shipped KV in); ``BlockKVSender``, a ``KVSender`` over one block transport (tests, benches).
- ``options``: the cluster config's ``kv_grpc`` / ``kv_nixl`` mappings checked and turned into
  the transports' typed configs.
"""
