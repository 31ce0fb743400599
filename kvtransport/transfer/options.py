"""The cluster config's transport tuning (``kv_grpc``, ``kv_nixl`` in kvnotes.yaml) turned into
the transports' own typed configs, :class:`~kvtransport.transfer.grpc_config.GrpcTransportConfig` and
:class:`~kvtransport.transfer.nixl_transport.NixlTransportConfig`; every prefill and decode actor builds
its transports from these, and ``kvnotes serve`` checks them before anything starts.

What the cluster decides is not an option: ``require_grant`` (every KV push needs the router's
grant: an inbox admits only a transfer the router announced, with its credential; see "The KV
data plane" in docs/architecture.md) is always on and refused as a key."""
from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os

from kvruntime.config import ClusterConfig

log = logging.getLogger(__name__)

#: set by the cluster itself, never by the config file
FIXED = ("require_grant",)


def confine_ucx(listen_host: str) -> str | None:
    """UCX (NIXL's backend) listens on every network device unless told otherwise: keep it on the
    device that holds kvnotes' listen address (``bind_host``, else the node's address), ``lo`` for
    loopback, via ``UCX_NET_DEVICES``. An operator's own ``UCX_NET_DEVICES`` is kept; an address no
    local device holds is logged and leaves UCX as it is. Call before a NIXL agent is created in
    this process. Returns the device chosen (None: none)."""
    if os.environ.get("UCX_NET_DEVICES"):
        return os.environ["UCX_NET_DEVICES"]
    device = ucx_device(listen_host)
    if device is None:
        log.warning("no network device of this host holds %s: UCX (NIXL) listens on every device", listen_host)
        return None
    os.environ["UCX_NET_DEVICES"] = device
    return device


def ucx_device(listen_host: str) -> str | None:
    """The name of the network device holding ``listen_host`` (``lo`` for loopback), or None."""
    try:
        ip = ipaddress.ip_address(listen_host)
    except ValueError:
        return "lo" if listen_host == "localhost" else None
    if ip.is_loopback:
        return "lo"
    import psutil
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            try:
                if ipaddress.ip_address(a.address.split("%")[0]) == ip:
                    return name
            except ValueError:          # a MAC address (AF_PACKET)
                continue
    return None


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
    from kvtransport.transfer.grpc_config import GrpcTransportConfig
    return _build(GrpcTransportConfig, "kv_grpc", cfg.transport.options("grpc"), require_grant=require_grant)


def nixl_config(cfg: ClusterConfig, *, require_grant: bool = True):
    """The NIXL transport's config from ``cfg.transport.nixl`` (imports no NIXL: the config is plain)."""
    from kvtransport.transfer.nixl_transport import NixlTransportConfig
    return _build(NixlTransportConfig, "kv_nixl", cfg.transport.options("nixl"), require_grant=require_grant)


def check(cfg: ClusterConfig) -> None:
    """ValueError naming the section and key when ``kv_grpc`` / ``kv_nixl`` is not a valid config."""
    grpc_config(cfg)
    nixl_config(cfg)
