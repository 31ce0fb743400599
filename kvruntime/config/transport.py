"""The ``transport`` section: how KV moves from a prefill actor to a decode actor (NIXL or gRPC),
each transport's own tuning, and what a decode actor does when a KV load fails. Flat keys in a
config file: ``kv_transport`` -> ``transport.kind``, ``kv_grpc`` -> ``transport.grpc``,
``kv_nixl`` -> ``transport.nixl``; the others keep their names."""
from __future__ import annotations

from dataclasses import dataclass

from kvruntime.config.choices import LoadFailurePolicy, TransportKind


@dataclass(frozen=True)
class TransportConfig:
    kind: TransportKind = TransportKind.AUTO   # auto (NIXL where it imports and starts, else gRPC) | nixl | grpc
    # tuning: a mapping of GrpcTransportConfig / NixlTransportConfig fields (kvtransport.options),
    # e.g. kv_grpc: {inbox_bytes: 8589934592}; checked by `kvnotes serve` before anything starts
    grpc: tuple = ()
    nixl: tuple = ()
    transfer_timeout_s: float = 30.0
    kv_load_failure_policy: LoadFailurePolicy = LoadFailurePolicy.RECOMPUTE  # recompute | fail

    def __post_init__(self):
        object.__setattr__(self, "kind", TransportKind.of(self.kind))
        object.__setattr__(self, "grpc", _options("kv_grpc", self.grpc))
        object.__setattr__(self, "nixl", _options("kv_nixl", self.nixl))
        if self.transfer_timeout_s <= 0:
            raise ValueError("transfer_timeout_s must be > 0")
        object.__setattr__(self, "kv_load_failure_policy", LoadFailurePolicy.of(self.kv_load_failure_policy))

    def options(self, transport: str) -> dict:
        """``grpc`` / ``nixl`` tuning as keyword arguments (``transport``: grpc | nixl)."""
        if transport not in ("grpc", "nixl"):
            raise ValueError(f"transport must be grpc or nixl, got {transport!r}")
        return dict(self.grpc if transport == "grpc" else self.nixl)


def _options(name: str, value) -> tuple:
    """A transport option mapping as a sorted tuple of (key, value) pairs (hashable, like the
    rest of the frozen config); lists become tuples. Keys are checked against the transport's
    own config class by :func:`kvtransport.options.check` (this module imports no transport)."""
    items = value.items() if isinstance(value, dict) else value
    try:
        pairs = [(k, tuple(v) if isinstance(v, list) else v) for k, v in items]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a mapping of option names to values") from None
    bad = [k for k, v in pairs if not isinstance(k, str) or not isinstance(v, (bool, int, float, str, tuple))]
    if bad:
        raise ValueError(f"{name}: option {bad[0]!r} must be a name with a number, string, boolean or list value")
    return tuple(sorted(pairs))
