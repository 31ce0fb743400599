"""decode_workers: receive a request's composed prefix KV from kvtransport, prefill the
remaining suffix, decode and stream tokens back; report TTFT. They never re-plan. The actor runs
either engine through one contract (``engine_api.DecodeEngine``; ``engines`` picks it from config).
The reference engine keeps each request's prefix KV (``held_kv``, byte-bounded LRU by token ids
+ salt) so a prefix it holds is not sent again (``actor.DecodeWorker.expect`` narrows the grant).
``vllm_shm`` removes the ``psm_*`` shared memory a SIGKILLed multiprocess vLLM server leaves in
``/dev/shm`` (used by the benches that run vLLM's own server; this package's engine has none).
"""
