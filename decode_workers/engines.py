"""Which decode engine a decode actor runs: the one place that reads ``decode_engine`` from
config. Both implement :class:`~decode_workers.engine_api.DecodeEngine`."""
from __future__ import annotations

from decode_workers.engine_api import DecodeEngine
from kvruntime.messages.config import ClusterConfig


def make_decode_engine(cfg: ClusterConfig, receiver, device: str) -> DecodeEngine:
    """The engine ``cfg.decode_engine`` names, receiving its blocks from ``receiver``."""
    if cfg.decode_engine == "vllm":
        from decode_workers.vllm_engine import VllmDecodeExecutor

        return VllmDecodeExecutor(
            cfg.model, dtype=cfg.dtype, device=device, load_failure_policy=cfg.kv_load_failure_policy,
            receive_timeout=cfg.transfer_timeout_s, receiver=receiver, kv_cache_gib=cfg.vllm_kv_cache_gib,
            max_model_len=cfg.vllm_max_model_len, threads=cfg.decode.threads,
            kv_load=cfg.vllm_kv_load, load_threads=cfg.vllm_kv_load_threads)
    from decode_workers.executor import DecodeExecutor
    from decode_workers.held_kv import HeldPrefixes
    from kvruntime.engine import ReferenceEngine

    engine = ReferenceEngine(cfg.model, dtype=cfg.dtype, device=device, threads=cfg.decode.threads)
    # the reference engine keeps prefix KV for the next request (vLLM has its own prefix cache)
    return DecodeExecutor(engine, receiver, load_failure_policy=cfg.kv_load_failure_policy,
                          receive_timeout=cfg.transfer_timeout_s, held=HeldPrefixes(cfg.decode_prefix_cache_bytes),
                          grammar_cache_entries=cfg.grammar_cache_entries)
