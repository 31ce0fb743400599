"""Per-session memory of the last cached context, so a changed template field next turn
becomes an erratum plan. Bounded (LRU); a dropped session just plans from scratch."""
from __future__ import annotations

import threading
from collections import OrderedDict

from cluster.planner import SessionContext


class SessionStore:
    def __init__(self, max_sessions: int = 10_000):
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        self._max = max_sessions
        self._d: OrderedDict[tuple[str, str], SessionContext] = OrderedDict()   # (tenant, session) -> context
        self._lock = threading.Lock()

    def get(self, tenant: str, session: str) -> SessionContext | None:
        with self._lock:
            ctx = self._d.get((tenant, session))
            if ctx is not None:
                self._d.move_to_end((tenant, session))
            return ctx

    def put(self, tenant: str, ctx: SessionContext) -> None:
        with self._lock:
            self._d[(tenant, ctx.session)] = ctx
            self._d.move_to_end((tenant, ctx.session))
            while len(self._d) > self._max:
                self._d.popitem(last=False)

    def __len__(self) -> int:
        return len(self._d)
