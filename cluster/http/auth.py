"""Who may do what: API keys map to tenants; the tenant of a request comes from its key.

- A key is ``kvn-`` + 43 random URL-safe characters (256 bits). The state store keeps only its
  SHA-256 (``hash_key``) and a public ``key_id`` (the hash's first 12 hex digits) used to list
  and revoke it; the key itself is shown once, at creation, and never logged.
- ``Authorization: Bearer <key>`` on every route but ``/health``, ``/ready`` and ``/metrics``;
  a missing, malformed, unknown or revoked key is a 401. Each router replica remembers a key the
  store confirmed for ``auth_cache_s`` (a revocation takes effect within it; a short state store
  outage does not stop keys seen recently).
- The ``x-kvnotes-tenant`` header is honoured only from a client address listed in the config's
  ``trusted_proxies`` (which must still send its own valid key); from anyone else it is ignored.
- ``auth: false`` (loopback binds only, checked by the config) makes every request the config's
  ``tenant``.
Everything a tenant owns (registrations, templates, sessions, the prompt index) is keyed by the
tenant in the state store, and its KV by a per-tenant salt derived from the cluster secret, so
one tenant can never name, list, use or delete another's.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import threading
import time
from pathlib import Path

from cluster.control.errors import RequestError
from cluster.control.state import ApiKeyRecord, StateStore

log = logging.getLogger(__name__)

KEY_PREFIX = "kvn-"
TENANT_HEADER = "x-kvnotes-tenant"
_TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_KEY_RE = re.compile(r"kvn-[A-Za-z0-9_-]{20,128}")
CACHE_MAX = 10_000        # validated keys one replica remembers (auth_cache_s); beyond it the oldest go first


def check_tenant(name) -> str:
    """A tenant name: 1-64 characters of ``A-Z a-z 0-9 . _ -``, starting with a letter or digit."""
    if not isinstance(name, str) or not _TENANT_RE.fullmatch(name):
        raise ValueError("tenant must be 1-64 characters of A-Z a-z 0-9 . _ - starting with a letter or digit")
    return name


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(state: StateStore, tenant: str) -> tuple[str, ApiKeyRecord]:
    """A new key for ``tenant``: (the key, shown once; its stored record)."""
    check_tenant(tenant)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    h = hash_key(key)
    rec = ApiKeyRecord(h[:12], tenant, time.time())
    state.put_api_key(h, rec)
    log.info("created API key %s for tenant %s", rec.key_id, tenant)
    return key, rec


def ensure_default_key(state: StateStore, tenant: str, path: Path) -> str | None:
    """The embedded default's key: the one saved in ``path`` if the store still knows it, else a
    new one for ``tenant`` when the store holds no key at all (saved to ``path``, mode 0600;
    the path is printed, never the key). None when other keys exist (made with ``kvnotes keys create``)."""
    path = Path(path).expanduser()
    if path.exists():
        key = path.read_text().strip()
        if state.api_key(hash_key(key)) is not None:
            return key
    if state.list_api_keys():
        return None
    key, rec = create_key(state, tenant)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    # the secret itself stays out of stdout (it ends up in service logs); the file is the handle
    print(f"kvnotes: created API key {rec.key_id} for tenant {tenant!r}, saved in {path} (mode 0600); "
          f"use it with: -H \"authorization: Bearer $(cat {path})\"", flush=True)
    return key


class Authenticator:
    """Maps a request's headers (and client address) to its tenant; 401 ``RequestError`` when it
    may not call the route. A key the store confirmed is trusted for ``cache_s`` seconds by this
    replica without reading the store again (config ``auth_cache_s``): a revoked key stops within
    ``cache_s``, and a key seen in the last ``cache_s`` keeps working through a state store outage.
    Unknown keys are never cached. A key the store must be asked about while it does not answer
    raises ``StateStoreUnavailable`` (503)."""

    def __init__(self, state: StateStore, *, enabled: bool, default_tenant: str,
                 trusted_proxies: tuple[str, ...] = (), cache_s: float = 0.0, cache_max: int = CACHE_MAX):
        self.state, self.enabled, self.default_tenant = state, enabled, default_tenant
        self.trusted = frozenset(trusted_proxies)
        self.cache_s, self.cache_max = cache_s, cache_max
        self._cache: dict[str, tuple[str, float]] = {}      # key hash -> (tenant, monotonic time it expires)
        self._lock = threading.Lock()

    def _tenant_of(self, key_hash: str) -> str | None:
        """The tenant of a key (cached), or None for an unknown or revoked key."""
        now = time.monotonic()
        hit = self._cache.get(key_hash)
        if hit is not None and hit[1] > now:
            return hit[0]
        rec = self.state.api_key(key_hash)
        with self._lock:
            self._cache.pop(key_hash, None)             # re-inserted below at the young end
            if rec is None or self.cache_s <= 0:
                return None if rec is None else rec.tenant
            if len(self._cache) >= self.cache_max:      # bounded: drop the expired, else the oldest
                for h in [h for h, (_, until) in self._cache.items() if until <= now] or [next(iter(self._cache))]:
                    del self._cache[h]
            self._cache[key_hash] = (rec.tenant, now + self.cache_s)
        return rec.tenant

    def tenant(self, headers, client_host: str | None) -> str:
        tenant = self._from_key(headers.get("authorization")) if self.enabled else self.default_tenant
        claimed = headers.get(TENANT_HEADER)
        if claimed is not None and client_host in self.trusted:
            try:
                return check_tenant(claimed)
            except ValueError as exc:
                raise RequestError(400, f"{TENANT_HEADER}: {exc}", param=TENANT_HEADER) from None
        return tenant

    def _from_key(self, header: str | None) -> str:
        if not header:
            raise RequestError(401, "missing API key: send 'Authorization: Bearer <key>' (create one with "
                                    "`kvnotes keys create --tenant NAME`)", code="invalid_api_key")
        scheme, _, key = header.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not _KEY_RE.fullmatch(key):
            raise RequestError(401, "malformed Authorization header: expected 'Bearer kvn-...'",
                               code="invalid_api_key")
        tenant = self._tenant_of(hash_key(key))
        if tenant is None:
            raise RequestError(401, "unknown or revoked API key", code="invalid_api_key")
        return tenant
