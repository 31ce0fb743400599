"""decode_workers: receive a request's composed prefix KV from kvtransport.transfer, prefill the
remaining suffix, decode and stream tokens back; report TTFT. They never re-plan. The actor runs
either engine through one contract (``engine_api.DecodeEngine``; ``engines`` picks it from config).
The reference engine keeps each request's prefix KV (``held_kv``, byte-bounded LRU by token ids
+ salt) so a prefix it holds is not sent again (``actor.DecodeWorker.expect`` narrows the grant).
The vLLM engine is ``vllm_engine`` (built from ``vllm_settings.VllmEngineConfig``); the KV
connector vLLM loads is ``vllm_connector``, a facade over ``vllm_connector_scheduler`` and
``vllm_connector_worker``; every use of vLLM beyond its public API, and the pinned version, is in
``vllm_adapter``.
"""
