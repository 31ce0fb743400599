"""kvtransport: where KV lives between requests and how it moves between workers, as two boxes
that never import each other (``tests/test_import_graph.py`` holds them to it):

- ``kvtransport.tier``: the KV tier. Prefill workers put and get whole chunks by ``ChunkKey``
  (LMCache behind a small store interface: local CPU, disk, ``fs://``, the ``lm://`` tier server).
- ``kvtransport.transfer``: the transfer. A prefill worker sends one request's composed prefix KV
  as one block (header + payload) to a decode worker, over NIXL or gRPC.

What both need lives below them, in ``kvruntime``: the dense KV (``kvruntime.kv.KVCache``) and the
messages (``kvruntime.messages``: chunk keys, grants, endpoints, config). The block format belongs
to the transfer alone: the tier stores LMCache's memory objects, never blocks. Neither box imports
``cluster`` or the worker packages; the workers and the control plane import them.
"""
