"""Who may do what: API keys map to tenants; the tenant of a request comes from its key.

- A key is ``kvn-`` + 43 random URL-safe characters (256 bits). The state store keeps only its
  SHA-256 (``hash_key``) and a public ``key_id`` (the hash's first 12 hex digits) used to list
  and revoke it; the key itself is shown once, at creation, and never logged.
- ``Authorization: Bearer <key>`` on every route but ``/health``, ``/ready`` and ``/metrics``;
  a missing, malformed, unknown or revoked key is a 401. Each router replica remembers a key the
  store confirmed for ``auth_cache_s`` (a revocation takes effect within it; a short state store
  outage does not stop keys seen recently).
- The ``x-kvnotes-tenant`` header is honoured only from a TCP peer in the config's
  ``trusted_proxies`` (addresses or networks; it must still send its own valid key); from anyone
  else it is ignored, whatever ``X-Forwarded-For`` says (``cluster.http.forwarded``).
- Unknown keys are remembered (``unknown_key_cache_s``) and rate-limited per client address
  (``unknown_key_rate_per_s``, ``unknown_key_burst``: 429), so random keys cannot keep the state
  store busy; the store is read off the event loop.
- ``auth: false`` (loopback binds only, checked by the config) makes every request the config's
  ``tenant``.
Everything a tenant owns (registrations, templates, sessions, the prompt index) is keyed by the
tenant in the state store, and its KV by a per-tenant salt derived from the cluster secret, so
one tenant can never name, list, use or delete another's.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import re
import secrets
import threading
import time
from pathlib import Path

from cluster.control.errors import RequestError
from cluster.control.state import ApiKeyRecord, StateStore
from kvruntime.private_files import write_private

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
    """The key of ``path``, the key file that belongs to this state store (``StateConfig.api_key_file``):
    the one saved there if the store knows it, else a new one for ``tenant`` when the store holds
    no key at all and ``path`` holds none either (saved mode 0600 in a 0700 directory; the path is
    printed, never the key). None when the store has other keys, or when ``path`` holds a key this
    store does not know: a key file is never overwritten (it may be another cluster's)."""
    path = Path(path).expanduser()
    held = path.read_text().strip() if path.exists() else ""
    if held and state.api_key(hash_key(held)) is not None:
        return held
    if held or state.list_api_keys():
        return None
    key, rec = create_key(state, tenant)
    write_private(path, key + "\n")
    # the secret itself stays out of stdout (it ends up in service logs) and off command lines (ps shows
    # them): the file is the handle
    print(f"kvnotes: created API key {rec.key_id} for tenant {tenant!r}, saved in {path} (mode 0600)", flush=True)
    return key


def no_key_hint(path: Path) -> str:
    """One line for a start whose key file holds no key of this state store: how to make one."""
    return (f"kvnotes: {path} holds no API key of this state store; make one with: (umask 077; kvnotes keys "
            f"create --tenant default [--config FILE] | tail -n 1 > {path})")


class Authenticator:
    """Maps a request's headers (and client address) to its tenant; 401 ``RequestError`` when it
    may not call the route. A key the store confirmed is trusted for ``cache_s`` seconds by this
    replica without reading the store again (config ``auth_cache_s``): a revoked key stops within
    ``cache_s``, and a key seen in the last ``cache_s`` keeps working through a state store outage.
    A key the store must be asked about while it does not answer raises ``StateStoreUnavailable`` (503).

    Unknown keys: one the store refused is refused again for ``unknown_cache_s`` without a store
    read, and each client address (``cluster.http.forwarded``) may have the store asked about keys it
    does not know ``unknown_rate_per_s`` times a second (bursts of ``unknown_burst``); past that a
    429 with Retry-After. Counted in ``kvnotes_auth_unknown_keys_total{outcome}`` (``store``: asked
    the store, ``cached``: the negative cache answered, ``rate_limited``). :meth:`of_request` asks
    the store off the event loop."""

    def __init__(self, state: StateStore, *, enabled: bool, default_tenant: str,
                 trusted_proxies: tuple[str, ...] = (), cache_s: float = 0.0, cache_max: int = CACHE_MAX,
                 unknown_cache_s: float = 0.0, unknown_rate_per_s: float = 0.0, unknown_burst: int = 20,
                 registry=None):
        from cluster.http.forwarded import Forwarding
        self.state, self.enabled, self.default_tenant = state, enabled, default_tenant
        self.forwarding = Forwarding(trusted_proxies)
        self.cache_s, self.cache_max = cache_s, cache_max
        self._cache: dict[str, tuple[str, float]] = {}      # key hash -> (tenant, monotonic time it expires)
        self._unknown = _Expiring(cache_max)                 # key hash -> when the refusal is forgotten
        self.unknown_cache_s = unknown_cache_s
        self._buckets = _Buckets(unknown_rate_per_s, unknown_burst, cache_max)
        self._lock = threading.Lock()
        self.unknown_keys = _unknown_counter(registry)

    def _cached(self, key_hash: str) -> str | None:
        hit = self._cache.get(key_hash)
        return hit[0] if hit is not None and hit[1] > time.monotonic() else None

    def _tenant_of(self, key_hash: str) -> str | None:
        """The tenant of a key (cached), or None for an unknown or revoked key."""
        hit = self._cached(key_hash)
        if hit is not None:
            return hit
        rec = self.state.api_key(key_hash)
        now = time.monotonic()
        with self._lock:
            self._cache.pop(key_hash, None)             # re-inserted below at the young end
            if rec is None:
                self.unknown_keys.labels("store").inc()
                if self.unknown_cache_s > 0:
                    self._unknown.put(key_hash, now + self.unknown_cache_s)
                return None
            if self.cache_s <= 0:
                return rec.tenant
            if len(self._cache) >= self.cache_max:      # bounded: drop the expired, else the oldest
                for h in [h for h, (_, until) in self._cache.items() if until <= now] or [next(iter(self._cache))]:
                    del self._cache[h]
            self._cache[key_hash] = (rec.tenant, now + self.cache_s)
        return rec.tenant

    def tenant(self, headers, client_host: str | None, xff=()) -> str:
        """The tenant of a request from TCP peer ``client_host`` with these ``X-Forwarded-For``
        values (blocking: it may read the state store)."""
        key_hash = self._key_hash(headers.get("authorization")) if self.enabled else None
        return self._finish(headers, client_host, xff, self._lookup(key_hash, client_host, xff))

    async def of_request(self, request) -> str:
        """:meth:`tenant` of a Starlette request; a state store read runs in a worker thread."""
        import anyio

        peer = request.client.host if request.client else None
        xff = request.headers.getlist(XFF)
        key_hash = self._key_hash(request.headers.get("authorization")) if self.enabled else None
        if key_hash is None or self._cached(key_hash) is not None:
            found = self._lookup(key_hash, peer, xff)
        else:
            found = await anyio.to_thread.run_sync(self._lookup, key_hash, peer, xff)
        return self._finish(request.headers, peer, xff, found)

    def _finish(self, headers, peer, xff, tenant: str) -> str:
        claimed = headers.get(TENANT_HEADER)
        if claimed is not None and self.forwarding.peer_trusted(peer, xff):
            try:
                return check_tenant(claimed)
            except ValueError as exc:
                raise RequestError(400, f"{TENANT_HEADER}: {exc}", param=TENANT_HEADER) from None
        return tenant

    def _lookup(self, key_hash: str | None, peer, xff) -> str:
        if key_hash is None:
            return self.default_tenant
        hit = self._cached(key_hash)
        if hit is not None:
            return hit
        if self._unknown.live(key_hash):
            self.unknown_keys.labels("cached").inc()
            raise RequestError(401, "unknown or revoked API key", code="invalid_api_key")
        addr = self.forwarding.client(peer, xff)
        wait = self._buckets.wait(addr)                 # only unknown keys spend tokens; an address out of them waits
        if wait > 0:
            self.unknown_keys.labels("rate_limited").inc()
            raise RequestError(429, "too many unknown API keys from this address; retry later",
                               code="rate_limit_exceeded", retry_after=wait)
        tenant = self._tenant_of(key_hash)
        if tenant is None:
            self._buckets.spend(addr)
            raise RequestError(401, "unknown or revoked API key", code="invalid_api_key")
        return tenant

    @staticmethod
    def _key_hash(header: str | None) -> str:
        if not header:
            raise RequestError(401, "missing API key: send 'Authorization: Bearer <key>' (create one with "
                                    "`kvnotes keys create --tenant NAME`)", code="invalid_api_key")
        scheme, _, key = header.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not _KEY_RE.fullmatch(key):
            raise RequestError(401, "malformed Authorization header: expected 'Bearer kvn-...'",
                               code="invalid_api_key")
        return hash_key(key)


XFF = "x-forwarded-for"


class _Expiring:
    """A bounded map key -> monotonic expiry (the oldest entries go first past ``cap``)."""

    def __init__(self, cap: int):
        self.cap, self._d, self._lock = cap, collections.OrderedDict(), threading.Lock()

    def put(self, k: str, until: float) -> None:
        with self._lock:
            self._d.pop(k, None)
            self._d[k] = until
            while len(self._d) > self.cap:
                self._d.popitem(last=False)

    def live(self, k: str) -> bool:
        until = self._d.get(k)
        return until is not None and until > time.monotonic()


class _Buckets:
    """Token buckets per client address: ``rate`` tokens a second, at most ``burst``; 0 = no limit."""

    def __init__(self, rate: float, burst: int, cap: int):
        self.rate, self.burst, self.cap = rate, burst, cap
        self._d: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _refill(self, addr: str, now: float) -> float:
        tokens, then = self._d.get(addr, (float(self.burst), now))
        return min(float(self.burst), tokens + (now - then) * self.rate)

    def wait(self, addr: str) -> float:
        """0 when ``addr`` has a token left, else the seconds until it has one."""
        if self.rate <= 0:
            return 0.0
        with self._lock:
            tokens = self._refill(addr, time.monotonic())
        return 0.0 if tokens >= 1 else (1 - tokens) / self.rate

    def spend(self, addr: str) -> None:
        """Take one token from ``addr`` (it asked the store about a key the store does not know)."""
        if self.rate <= 0:
            return
        now = time.monotonic()
        with self._lock:
            tokens = self._refill(addr, now)
            self._d.pop(addr, None)
            self._d[addr] = (max(0.0, tokens - 1), now)
            while len(self._d) > self.cap:
                self._d.popitem(last=False)


def _unknown_counter(registry):
    from prometheus_client import CollectorRegistry, Counter
    return Counter("kvnotes_auth_unknown_keys", "API keys the state store does not know, by what answered "
                   "(store: a store read; cached: the negative cache; rate_limited: 429 for the address)",
                   ["outcome"], registry=registry if registry is not None else CollectorRegistry())
