"""Records of the state store and the interface both backends implement."""
from __future__ import annotations

import functools
import inspect
import json
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class StoreLimits:
    session_ttl_s: float = 86400.0       # a session unused this long is gone
    session_max: int = 100_000           # at most this many sessions (least recently used dropped)
    prompt_ttl_s: float = 3600.0         # prompt-index entries unused this long are gone
    prompt_max: int = 200_000            # at most this many prompt-index entries (LRU)
    timeout_s: float = 2.0               # a Redis round trip (connect or answer) fails after this: a dead store fails fast
    fingerprint_ttl_s: float = 86400.0   # prompt-matching fingerprints unused this long are gone
    fingerprint_max: int = 200_000       # at most this many fingerprints (LRU), all tenants together
    held_prompt_ttl_s: float = 3600.0    # held prompts' token ids (edit detection) unused this long are gone
    held_prompt_max: int = 5_000         # at most this many held prompts (LRU; each up to a context of ids)
    response_ttl_s: float = 7 * 86400.0  # stored /v1/responses answers are gone this long after they were stored
    response_max: int = 20_000           # at most this many stored responses, all tenants together (oldest dropped)
    decode_held_ttl_s: float = 1800.0    # records of what a decode engine's prefix cache holds, unused this long, go
    decode_held_max: int = 100_000       # at most this many such block records, all tenants together (LRU)

    def __post_init__(self):
        if min(self.session_ttl_s, self.prompt_ttl_s, self.fingerprint_ttl_s, self.held_prompt_ttl_s) <= 0 \
                or min(self.session_max, self.prompt_max, self.fingerprint_max, self.held_prompt_max) < 1:
            raise ValueError("TTLs must be > 0 and maximum counts >= 1")
        if not 0 < self.timeout_s <= 60:
            raise ValueError(f"the state store timeout must be in (0, 60] s, got {self.timeout_s}")
        if self.response_ttl_s <= 0 or self.response_max < 1:
            raise ValueError("response_ttl_s must be > 0 and response_max >= 1")
        if not 0 < self.decode_held_ttl_s < float("inf") or self.decode_held_max < 1:
            raise ValueError("decode_held_ttl_s must be > 0 and decode_held_max >= 1")


class StateStoreUnavailable(ConnectionError):
    """The state store did not answer: down, unreachable, timed out, or still loading its data.
    Every :class:`StateStore` method raises it in place of its backend's own error, so callers
    need not know the backend; the HTTP edge answers 503 ``state_store_unavailable`` with
    ``Retry-After``. ``op`` is the method that failed."""

    def __init__(self, op: str, cause: BaseException, where: str = ""):
        super().__init__(f"state store {where + ' ' if where else ''}does not answer "
                         f"({op}: {type(cause).__name__}: {cause})")
        self.op = op


def _translating(op: str, fn):
    """``fn`` with its backend's outage errors raised as :class:`StateStoreUnavailable` (and
    reported to the store's ``on_unavailable``)."""
    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except StateStoreUnavailable:
            raise
        except Exception as exc:
            if not self._is_outage(exc):
                raise
            err = StateStoreUnavailable(op, exc)
            hook = self.on_unavailable
            if hook is not None:
                hook(op, err)
            raise err from exc
    return call


@dataclass(frozen=True)
class Registration:
    """A registered skill or memory. Its KV is addressed by content (``key``), not by name."""
    tenant: str
    kind: str                        # "skill" | "memory"
    name: str
    text: str
    token_ids: tuple[int, ...]       # text tokenized once at registration
    token_hash: str                  # sha256 of token_ids (kvruntime.messages.keys.token_hash)
    key: str                         # KVRef.digest of the chunk (display; the tier key is derived)
    created: float                   # unix seconds
    last_used: float                 # unix seconds: registration or last request that named it
    in_tier: bool | None = None      # last seen in the tier (None: not looked up since registration)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(s: str) -> "Registration":
        d = json.loads(s)
        return Registration(**{**d, "token_ids": tuple(d["token_ids"])})


@dataclass(frozen=True)
class TemplateRecord:
    tenant: str
    name: str
    text: str                                    # str.format template
    fields: tuple[str, ...]                      # placeholders in order of appearance
    labels: tuple[tuple[str, str], ...] = ()     # field -> human label for errata
    version: str = ""                            # hash of text + labels: a session notices a re-registration
    created: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(s: str) -> "TemplateRecord":
        d = json.loads(s)
        return TemplateRecord(**{**d, "fields": tuple(d["fields"]), "labels": tuple(tuple(x) for x in d["labels"])})


@dataclass(frozen=True)
class ApiKeyRecord:
    """An API key as stored: only the SHA-256 of the key, never the key itself."""
    key_id: str                      # public handle: the first 12 hex digits of the hash (list / revoke)
    tenant: str                      # every request made with the key acts as this tenant
    created: float                   # unix seconds

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(s) -> "ApiKeyRecord":
        return ApiKeyRecord(**json.loads(s))


class StateStore(ABC):
    """Durable control-plane state. Every method is one short round trip (SQLite transaction or a
    few Redis commands), safe to call from several threads, processes and replicas at once.
    Writes are last-writer-wins per key. Reads of sessions and prompt-index entries refresh their
    LRU position; expired entries read as absent."""

    limits: StoreLimits
    # called as (operation, StateStoreUnavailable) on every call the store did not answer: the
    # router replica's StoreWatch counts it and marks the store down at once
    on_unavailable = None

    def __init_subclass__(cls, **kwargs):
        """Every public method a backend defines raises :class:`StateStoreUnavailable` when the
        store does not answer (the backend says which errors mean that: :meth:`_is_outage`)."""
        super().__init_subclass__(**kwargs)
        for name, fn in list(vars(cls).items()):
            if inspect.isfunction(fn) and not name.startswith("_") and name != "close":
                setattr(cls, name, _translating(name, fn))

    def _is_outage(self, exc: BaseException) -> bool:
        """True when ``exc`` means the store did not answer (not a bug or bad data)."""
        return False

    @abstractmethod
    def ping(self) -> None:
        """One cheap round trip (the replica's periodic probe); raises StateStoreUnavailable."""

    # ---- registrations (skills, memories) -------------------------------------------------------
    @abstractmethod
    def put_registration(self, reg: Registration) -> None:
        """Insert or replace (tenant, kind, name)."""

    @abstractmethod
    def get_registration(self, tenant: str, kind: str, name: str) -> Registration | None: ...

    @abstractmethod
    def list_registrations(self, tenant: str, kind: str) -> list[Registration]:
        """Sorted by name."""

    @abstractmethod
    def registrations_by_tier(self) -> dict[tuple[str, str], int]:
        """Registrations of every tenant by (kind, in_tier: "true" | "false" | "unknown"), as last
        looked up (``kvnotes_registered_chunks`` gauge)."""

    @abstractmethod
    def delete_registration(self, tenant: str, kind: str, name: str) -> bool:
        """True if it existed."""

    @abstractmethod
    def mark_used(self, tenant: str, kind: str, name: str, now: float, in_tier: bool | None) -> None:
        """Record a use (last_used) and, when not None, whether the tier held the chunk."""

    # ---- templates --------------------------------------------------------------------------
    @abstractmethod
    def put_template(self, t: TemplateRecord) -> None: ...

    @abstractmethod
    def get_template(self, tenant: str, name: str) -> TemplateRecord | None: ...

    @abstractmethod
    def list_templates(self, tenant: str) -> list[TemplateRecord]: ...

    @abstractmethod
    def delete_template(self, tenant: str, name: str) -> bool: ...

    # ---- sessions (bounded) -------------------------------------------------------------------
    @abstractmethod
    def put_session(self, tenant: str, session: str, data: str, now: float) -> None:
        """Store a session's context (an opaque JSON string, see ``cluster.control.sessions``)."""

    @abstractmethod
    def get_session(self, tenant: str, session: str, now: float) -> str | None: ...

    @abstractmethod
    def delete_session(self, tenant: str, session: str) -> bool: ...

    # ---- plain-prompt prefix index (bounded) --------------------------------------------------
    @abstractmethod
    def put_prompt_blocks(self, tenant: str, blocks: dict[str, int], now: float) -> None:
        """``blocks``: hash of a prompt prefix -> its length in tokens."""

    @abstractmethod
    def get_prompt_blocks(self, tenant: str, hashes: list[str], now: float) -> dict[str, int]:
        """The subset of ``hashes`` present (not expired), with their lengths."""

    # ---- prompt-matching fingerprints (bounded; cluster.control.fingerprints) --------------------
    @abstractmethod
    def count_fingerprints(self, tenant: str, keys: list[str], now: float) -> dict[str, int]:
        """Add one sighting to each of ``keys`` (created at 0 when absent, atomic across
        replicas); returns each key's count after it."""

    @abstractmethod
    def put_fingerprints(self, tenant: str, entries: dict[str, str], now: float) -> None:
        """Set each key's data (an opaque string; its count is kept, 0 for a new key)."""

    @abstractmethod
    def get_fingerprints(self, tenant: str, keys: list[str], now: float,
                         touch: bool = True) -> dict[str, tuple[int, str]]:
        """The subset of ``keys`` present (not expired): key -> (count, data); refreshes their LRU
        (``touch=False``: a read only, the caller refreshes them later, off the request path)."""

    @abstractmethod
    def delete_fingerprints(self, tenant: str, keys: list[str]) -> int:
        """Drop ``keys``; returns how many existed."""

    @abstractmethod
    def put_held_prompt(self, tenant: str, key: str, token_ids: tuple[int, ...], now: float) -> None:
        """The token ids of a prompt the tier holds (``key``: its prompt-index hash)."""

    @abstractmethod
    def get_held_prompt(self, tenant: str, key: str, now: float, touch: bool = True) -> tuple[int, ...] | None:
        """The ids, refreshing the entry's LRU (``touch=False``: a read only, refreshed later)."""

    # ---- what the decode engines' own prefix caches hold (bounded; cluster.control.decode_held) ---
    @abstractmethod
    def put_decode_held(self, tenant: str, blocks: dict[str, int], now: float) -> None:
        """``blocks``: key (a decode actor incarnation and a block-chain hash of a prompt's leading
        tokens) -> tokens. Refreshes their TTL and LRU position."""

    @abstractmethod
    def get_decode_held(self, tenant: str, keys: list[str], now: float) -> dict[str, int]:
        """The subset of ``keys`` present (not expired), with their values; a read only (the next
        ``put_decode_held`` of a prompt refreshes its records)."""

    # ---- stored responses (/v1/responses with store: bounded, expiring; cluster.http.responses) ---
    @abstractmethod
    def put_response(self, tenant: str, response_id: str, data: str, now: float) -> None:
        """Store a response (an opaque JSON string) under the tenant; it expires ``response_ttl_s``
        after ``now``, and the oldest go first past ``response_max``."""

    @abstractmethod
    def get_response(self, tenant: str, response_id: str, now: float) -> str | None:
        """The stored JSON, None when unknown, expired or another tenant's."""

    @abstractmethod
    def delete_response(self, tenant: str, response_id: str) -> bool:
        """True if it existed."""

    # ---- API keys (hashed) ----------------------------------------------------------------------
    @abstractmethod
    def put_api_key(self, key_hash: str, rec: ApiKeyRecord) -> None:
        """Store a key by its SHA-256 hex digest (``cluster.http.auth.hash_key``)."""

    @abstractmethod
    def api_key(self, key_hash: str) -> ApiKeyRecord | None:
        """The record of a key by its hash; None when unknown or revoked."""

    @abstractmethod
    def list_api_keys(self) -> list[ApiKeyRecord]:
        """Every live key, oldest first."""

    @abstractmethod
    def revoke_api_key(self, key_id: str) -> bool:
        """Delete the key whose ``key_id`` this is; True if it existed."""

    # ---- metrics targets (router replicas announce their own exporter) ----------------------
    @abstractmethod
    def put_target(self, name: str, address: str, now: float) -> None:
        """Announce (or refresh) process ``name``'s metrics endpoint ``host:port``."""

    @abstractmethod
    def targets(self, now: float, ttl_s: float) -> dict[str, str]:
        """name -> address of every target refreshed within ``ttl_s``; older ones are dropped."""

    # ---- cluster secret, sizes, lifecycle -----------------------------------------------------
    @abstractmethod
    def secret(self) -> bytes:
        """The cluster's secret (32 random bytes), created by the first caller, the same for all."""

    @abstractmethod
    def sizes(self, now: float) -> dict[str, int]:
        """Live entries: ``sessions``, ``prompt_index``, ``registrations``, ``templates``,
        ``fingerprints``, ``held_prompts``, ``decode_held``."""

    @abstractmethod
    def expire(self, now: float) -> dict[str, int]:
        """Drop expired and over-limit sessions / prompt entries / fingerprints / held prompts /
        decode-held records now; returns how many of each."""

    def close(self) -> None:
        """Release connections."""


_SECRET_PARAMS = frozenset({"password", "pass", "passwd", "pwd", "secret", "token", "auth", "key", "api_key",
                            "access_token", "credential", "credentials"})


def redact_url(url: str) -> str:
    """``url`` with every password in it replaced by ``***`` (what logs and errors show): the
    user part's (``redis://user:PW@host``, also one without a user or with an ``@`` in it), and
    query or fragment parameters named like a secret (``?password=PW``, ``&token=...``, any case)."""
    from urllib.parse import urlsplit, urlunsplit
    try:
        parts = urlsplit(url)
        parts.port                    # a malformed port raises here, not later in a log call
    except (ValueError, TypeError):
        return "<unparseable url>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user = userinfo.partition(":")[0]
        netloc = f"{user}:***@{host}"
    query, fragment = _redact_params(parts.query), _redact_params(parts.fragment)
    if (netloc, query, fragment) == (parts.netloc, parts.query, parts.fragment):
        return url                    # nothing to hide (urlunsplit would rewrite sqlite:////path)
    return urlunsplit(parts._replace(netloc=netloc, query=query, fragment=fragment))


def _redact_params(text: str) -> str:
    if not text:
        return text
    out = []
    for pair in text.split("&"):
        name, eq, _ = pair.partition("=")
        out.append(f"{name}=***" if eq and name.strip().lower() in _SECRET_PARAMS else pair)
    return "&".join(out)
