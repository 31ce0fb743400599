"""decode_workers: receive a request's composed prefix KV from kvtransport.transfer, prefill the
remaining suffix, decode and stream tokens back; report TTFT. They never re-plan. The actor runs
either engine through one contract (``engine_api.DecodeEngine``; ``engines`` picks it from config).
The reference engine keeps each request's prefix KV (``held_kv``, byte-bounded LRU by token ids
+ salt) so a prefix it holds is not sent again (``actor.DecodeWorker.expect`` narrows the grant).
"""
