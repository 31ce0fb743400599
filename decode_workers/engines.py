"""Which decode engine a decode actor runs: the one place that reads ``decode_engine`` from
config. Both implement :class:`~decode_workers.engine_api.DecodeEngine`."""
from __future__ import annotations

from decode_workers.engine_api import DecodeEngine
from kvruntime.config import ClusterConfig


def make_decode_engine(cfg: ClusterConfig, receiver, device: str) -> DecodeEngine:
    """The engine ``cfg.workers.decode_engine`` names, receiving its blocks from ``receiver``."""
    if cfg.workers.decode_engine == "vllm":
        from decode_workers.vllm_engine import VllmDecodeExecutor
        from decode_workers.vllm_settings import VllmEngineConfig

        return VllmDecodeExecutor(VllmEngineConfig.from_cluster(cfg, device), receiver)
    from decode_workers.executor import DecodeExecutor
    from decode_workers.held_kv import HeldPrefixes
    from kvruntime.engine import ReferenceEngine

    # no RoPE self-test: decode never re-rotates keys (prefill does, after its own); the table stays
    # disabled, so a rotation here would raise RepositionDisabled, not run unchecked (~1 s CPU a start)
    engine = ReferenceEngine(cfg.workers.model, dtype=cfg.workers.dtype, device=device, threads=cfg.workers.decode.threads,
                             shapes=cfg.workers.few_token_shapes, run_self_test=False)
    # the reference engine keeps prefix KV for the next request (vLLM has its own prefix cache)
    return DecodeExecutor(engine, receiver, load_failure_policy=cfg.transport.kv_load_failure_policy,
                          receive_timeout=cfg.transport.transfer_timeout_s, held=HeldPrefixes(cfg.workers.decode_prefix_cache_bytes),
                          grammar_cache_entries=cfg.workers.grammar_cache_entries)
