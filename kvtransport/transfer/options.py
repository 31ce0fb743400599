"""The cluster config's transport tuning (``kv_grpc``, ``kv_nixl`` in kvnotes.yaml) turned into
the transports' own typed configs, :class:`~kvtransport.transfer.grpc_transport.GrpcTransportConfig` and
:class:`~kvtransport.transfer.nixl_transport.NixlTransportConfig`; every prefill and decode actor builds
its transports from these, and ``kvnotes serve`` checks them before anything starts.

What the cluster decides is not an option: ``require_grant`` (every KV push needs the router's
grant: an inbox admits only a transfer the router announced, with its credential; see "The KV
data plane" in docs/architecture.md) is always on and refused as a key."""
from __future__ import annotations

import dataclasses
import ipaddress
import os

from kvruntime.config import ClusterConfig

#: set by the cluster itself, never by the config file
FIXED = ("require_grant",)


def confine_ucx(listen_host: str) -> None:
    """UCX (NIXL's backend) listens on every network device unless told otherwise: when kvnotes'
    listeners are on loopback, keep UCX there too (``UCX_NET_DEVICES=lo``). An operator's own
    ``UCX_NET_DEVICES`` is kept. Call before a NIXL agent is created in this process."""
    try:
        loopback = ipaddress.ip_address(listen_host).is_loopback
    except ValueError:
        loopback = listen_host == "localhost"
    if loopback:
        os.environ.setdefault("UCX_NET_DEVICES", "lo")


def _build(cls, section: str, options: dict, **fixed):
    names = {f.name for f in dataclasses.fields(cls)}
    for key in options:
        if key in FIXED:
            raise ValueError(f"{section}: {key} is not a setting (the cluster always requires grants)")
        if key not in names:
            raise ValueError(f"{section}: unknown option {key!r}; options are {', '.join(sorted(names - set(FIXED)))}")
    try:
        return cls(**{**options, **fixed})
    except ValueError as exc:
        raise ValueError(f"{section}: {exc}") from None
    except TypeError as exc:
        raise ValueError(f"{section}: {exc}") from None


def grpc_config(cfg: ClusterConfig, *, require_grant: bool = True):
    """The gRPC transport's config from ``cfg.transport.grpc``."""
    from kvtransport.transfer.grpc_transport import GrpcTransportConfig
    return _build(GrpcTransportConfig, "kv_grpc", cfg.transport.options("grpc"), require_grant=require_grant)


def nixl_config(cfg: ClusterConfig, *, require_grant: bool = True):
    """The NIXL transport's config from ``cfg.transport.nixl`` (imports no NIXL: the config is plain)."""
    from kvtransport.transfer.nixl_transport import NixlTransportConfig
    return _build(NixlTransportConfig, "kv_nixl", cfg.transport.options("nixl"), require_grant=require_grant)


def check(cfg: ClusterConfig) -> None:
    """ValueError naming the section and key when ``kv_grpc`` / ``kv_nixl`` is not a valid config."""
    grpc_config(cfg)
    nixl_config(cfg)
