"""The config's enumerated settings, one class each, each validated here and nowhere else.

A config section turns the file's string into its member when it is built
(``TransportConfig(kind="grpc").kind is TransportKind.GRPC``); a component receives that member
and never checks the string again. A component that is also built directly (tests, benches)
calls :meth:`Choice.of`, the same single check. Members are ``StrEnum``: they compare equal to,
format and JSON-encode as their value (``f"{TransportKind.GRPC}" == "grpc"``), so metric labels,
logs and the wire keep today's strings."""
from __future__ import annotations

from enum import StrEnum


class Choice(StrEnum):
    """Base of every enumerated setting: ``of(value)`` is the member, or a ValueError naming the
    config key (:attr:`_key`) and the allowed values."""

    @classmethod
    def of(cls, value, key: str | None = None) -> "Choice":
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(m.value for m in cls)
            raise ValueError(f"{key or cls._key()} must be one of {allowed}, got {value!r}") from None

    @classmethod
    def _key(cls) -> str:
        return cls.__name__


class TransportKind(Choice):
    """``kv_transport``: how KV moves prefill -> decode. ``auto``: NIXL where it imports and
    starts, else gRPC (counted: ``kv_transport_nixl_unavailable``)."""
    AUTO = "auto"
    NIXL = "nixl"
    GRPC = "grpc"

    @classmethod
    def _key(cls) -> str:
        return "kv_transport"


class LoadFailurePolicy(Choice):
    """``kv_load_failure_policy``: what a worker does when KV it was promised is missing or unusable
    (a tier miss mid-plan, a block that never arrived): recompute it (counted) or fail the request."""
    RECOMPUTE = "recompute"
    FAIL = "fail"

    @classmethod
    def _key(cls) -> str:
        return "kv_load_failure_policy"


class ForwardShapes(Choice):
    """``few_token_shapes``: the reference engine's forwards of <= 64 new tokens at their own shape
    (eager) or padded to a bucket (1, 2, 4, ... 64) with the keys read through a length
    (kvruntime.buckets: the static shapes a captured graph needs; on the CPU no faster)."""
    EAGER = "eager"
    BUCKETED = "bucketed"

    @classmethod
    def _key(cls) -> str:
        return "few_token_shapes"


class DecodeEngineKind(Choice):
    """``decode_engine``: the reference engine (torch oracle) or vLLM v1 with the kvnotes connector."""
    REFERENCE = "reference"
    VLLM = "vllm"

    @classmethod
    def _key(cls) -> str:
        return "decode_engine"


class KVLoadMode(Choice):
    """``vllm_kv_load``: ``async`` (running streams keep decoding while a block loads) or ``sync``."""
    ASYNC = "async"
    SYNC = "sync"

    @classmethod
    def _key(cls) -> str:
        return "vllm_kv_load"


class TierConnector(Choice):
    """``tier_connector``: where LMCache's connector keeps the KV it copies (``cpu``, or ``cuda``
    for a GPU prefill engine; ``kvtransport.tier.lmcache_connector.make_connector``)."""
    CPU = "cpu"
    CUDA = "cuda"

    @classmethod
    def _key(cls) -> str:
        return "tier_connector"


class ShadowMetric(Choice):
    """``shadow_metric``: the agreement a shadow check compares with its operation's target
    (``cluster.control.shadow``): top-1 next-token agreement, or greedy-16 exact match."""
    TOP1 = "top1"
    GREEDY_EXACT = "greedy_exact"

    @classmethod
    def _key(cls) -> str:
        return "shadow_metric"
