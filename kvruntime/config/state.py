"""The ``state`` section: the store of what survives a restart (registrations, templates,
sessions, the prompt index, API keys, the cluster secret) and how long entries live. Flat keys
in a config file: ``state_url`` -> ``state.url``, ``state_timeout_s`` -> ``state.timeout_s``,
``state_probe_s`` -> ``state.probe_s``; the others keep their names."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class StateConfig:
    # None: sqlite:///<data_dir>/state.db; or sqlite:///PATH, redis://[:PASSWORD@]HOST:PORT/DB, rediss://... (TLS);
    # in a config file ${VAR} is read from the environment (only here); kept out of repr (it may hold a password)
    url: str | None = field(default=None, repr=False)
    data_dir: str = "~/.local/share/kvnotes"   # default home of the SQLite state file
    session_ttl_s: float = 86400.0             # a session unused this long is forgotten
    session_max: int = 100_000                 # and at most this many are kept (least recently used go first)
    prompt_index_ttl_s: float = 3600.0         # plain-prompt prefix index entries expire after this
    prompt_index_max: int = 200_000            # and at most this many block hashes are kept (LRU)
    timeout_s: float = 2.0                     # a Redis call without an answer within this fails: 503 state_store_unavailable
    probe_s: float = 1.0                       # each router replica pings the state store this often (/ready, kvnotes_state_store_up)
    response_ttl_s: float = 7 * 86400.0        # a stored /v1/responses answer is gone this long after it was stored
    response_max: int = 20_000                 # and at most this many are kept, all tenants together (oldest go first)
    decode_held_ttl_s: float = 1800.0          # the router's shared record of what each decode engine's prefix cache holds
    decode_held_max: int = 100_000             # (cluster.control.decode_held): TTL, and at most this many block records (LRU)

    def __post_init__(self):
        if self.url is not None and not (isinstance(self.url, str)
                                         and self.url.startswith(("sqlite:///", "redis://", "rediss://"))):
            raise ValueError("state_url must start with sqlite:///, redis:// or rediss://")
        if not 0 < self.timeout_s <= 60 or not 0 < self.probe_s <= 60:
            raise ValueError("state_timeout_s and state_probe_s must be in (0, 60] seconds")
        if self.session_ttl_s <= 0 or self.prompt_index_ttl_s <= 0 or self.session_max < 1 or self.prompt_index_max < 1:
            raise ValueError("session_ttl_s, prompt_index_ttl_s > 0 and session_max, prompt_index_max >= 1 required")
        if isinstance(self.response_ttl_s, bool) or not isinstance(self.response_ttl_s, (int, float)) \
                or not 0 < self.response_ttl_s < float("inf"):
            raise ValueError(f"response_ttl_s must be a number of seconds > 0, got {self.response_ttl_s!r}")
        if isinstance(self.response_max, bool) or not isinstance(self.response_max, int) or self.response_max < 1:
            raise ValueError(f"response_max must be an integer >= 1, got {self.response_max!r}")
        if isinstance(self.decode_held_ttl_s, bool) or not isinstance(self.decode_held_ttl_s, (int, float)) \
                or not 0 < self.decode_held_ttl_s < float("inf") or isinstance(self.decode_held_max, bool) \
                or not isinstance(self.decode_held_max, int) or self.decode_held_max < 1:
            raise ValueError(f"decode_held_ttl_s must be seconds > 0 and decode_held_max an integer >= 1, got "
                             f"{self.decode_held_ttl_s!r} and {self.decode_held_max!r}")

    def store_limits(self) -> dict:
        """The state store's bounds from this section, as ``cluster.control.state.StoreLimits``
        keywords (the fields it does not name keep their defaults)."""
        return {"session_ttl_s": self.session_ttl_s, "session_max": self.session_max,
                "prompt_ttl_s": self.prompt_index_ttl_s, "prompt_max": self.prompt_index_max,
                "timeout_s": self.timeout_s, "response_ttl_s": self.response_ttl_s, "response_max": self.response_max,
                "decode_held_ttl_s": self.decode_held_ttl_s, "decode_held_max": self.decode_held_max}

    @property
    def api_key_file(self) -> Path:
        """Where the key created on a state store's first start is kept (mode 0600): it belongs to
        that store. The embedded default's store: ``<data_dir>/api_key``; another SQLite file:
        beside it (``state.db`` -> ``state.db.api_key``); a Redis store: ``<data_dir>/api_key-<id>``,
        ``<id>`` naming the store (host, port, db; never its password)."""
        if not self.url:
            return Path(self.data_dir).expanduser() / "api_key"
        if self.url.startswith("sqlite:///"):
            db = Path(self.url[len("sqlite:///"):]).expanduser()
            return db.with_name(db.name + ".api_key")
        import hashlib
        from urllib.parse import urlsplit
        parts = urlsplit(self.url)
        ident = f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"     # the password left out
        return Path(self.data_dir).expanduser() / f"api_key-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"

    @property
    def resolved_url(self) -> str:
        """``url``, or the SQLite file in ``data_dir`` (the embedded default)."""
        if self.url:
            return self.url
        return "sqlite:///" + str(Path(self.data_dir).expanduser() / "state.db")
