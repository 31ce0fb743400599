"""Per-session memory of the last cached context, kept in the state store so that any router
replica (and a restarted one) plans the next turn as an erratum or an edit. Bounded by the
store (TTL + LRU); a dropped session just plans from scratch. This module owns the JSON codec
of :class:`~cluster.control.planner.SessionContext`."""
from __future__ import annotations

import json
import time
from dataclasses import asdict

from cluster.control.planner import RenderedSegment, SessionContext
from cluster.control.state import StateStore
from kvruntime.messages.plan import KVRef


def _t(x):
    """Lists (JSON) back to the tuples the frozen dataclasses hold, recursively."""
    return tuple(_t(v) for v in x) if isinstance(x, list) else x


def _segment(d: dict) -> RenderedSegment:
    kv = d.pop("kv")
    return RenderedSegment(**{k: _t(v) for k, v in d.items()}, kv=KVRef(**{k: _t(v) for k, v in kv.items()})
                           if kv else None)


def encode_session(ctx: SessionContext) -> str:
    return json.dumps(asdict(ctx), separators=(",", ":"))


def decode_session(s: str) -> SessionContext:
    d = json.loads(s)
    return SessionContext(
        session=d["session"], context=KVRef(**{k: _t(v) for k, v in d["context"].items()}),
        segments=tuple(_segment(x) for x in d["segments"]), token_ids=tuple(d["token_ids"]),
        current_fields=_t(d["current_fields"]), errata=d["errata"])


class SessionStore:
    def __init__(self, state: StateStore):
        self.state = state

    def get(self, tenant: str, session: str) -> SessionContext | None:
        raw = self.state.get_session(tenant, session, time.time())
        return decode_session(raw) if raw is not None else None

    def put(self, tenant: str, ctx: SessionContext) -> None:
        self.state.put_session(tenant, ctx.session, encode_session(ctx), time.time())
