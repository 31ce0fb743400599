"""The state store: what must survive a router restart lives here, not in a process.

Registrations (skills and memories: text, token ids, content key, created / last used, whether
the tier still holds them), templates, sessions (each one's last cached context), the
plain-prompt prefix index, what the decode engines' prefix caches hold (``decode_held``), API keys (only their SHA-256) and the cluster secret that salts tenants' KV keys. Router replicas are
stateless: each reads and writes this store, so a registration made through one replica is
usable through another at once, and a restarted replica loses nothing.

Two backends behind one interface (``base.StateStore``), passing the same contract tests:
- ``sqlite:///PATH`` (the embedded default, a file in the data directory; WAL, safe for several
  processes on one node);
- ``redis://HOST:PORT/DB`` (multi-node: a real ``redis-server``), with a password
  (``redis://:PASSWORD@HOST:PORT/DB``, ``redis://USER:PASSWORD@...`` for an ACL user) and TLS
  (``rediss://``; ``?ssl_ca_certs=PATH`` names the CA). The password never appears in logs or
  errors: :func:`redact_url` is what is ever shown of a state URL.
Sessions and the prompt index are bounded: a TTL and a maximum count (least recently used go
first), with their sizes exported as gauges.
A store that does not answer raises ``StateStoreUnavailable`` from every method (both backends);
each router replica watches it (``watch.StoreWatch``: a probe every ``state_probe_s``).
"""
from __future__ import annotations

from cluster.control.state.base import (ApiKeyRecord, Registration, StateStore, StateStoreUnavailable,  # noqa: F401
                                        StoreLimits, TemplateRecord, redact_url)


def configured_limits(cfg) -> StoreLimits:
    """The bounds a cluster config sets (its ``state`` and ``matching`` sections), for every
    process that opens the store (router replicas, the CLI, the launcher): a trim anywhere keeps
    the configured TTLs and maximum counts, not the defaults."""
    return StoreLimits(**cfg.state.store_limits(), **cfg.matching.store_limits())


def open_state(url: str, limits: "StoreLimits | None" = None) -> StateStore:
    """Open the store named by ``url`` (``sqlite:///PATH``, ``redis://...`` or ``rediss://...``).
    Raises ``ValueError`` for an unknown scheme, ``StateStoreUnavailable`` (a ``ConnectionError``)
    when Redis does not answer, a plain ``ConnectionError`` when it refuses the credentials (one
    line each, the password redacted)."""
    limits = limits or StoreLimits()
    if url.startswith("sqlite:///"):
        from cluster.control.state.sqlite import SqliteState
        return SqliteState(url[len("sqlite:///"):], limits)
    if url.startswith(("redis://", "rediss://")):
        from cluster.control.state.redis_state import RedisState
        return RedisState(url, limits)
    raise ValueError(f"state_url must start with sqlite:///, redis:// or rediss://, got {redact_url(url)!r}")
