"""What the decode engine's own prefix cache holds exactly, as this router replica last saw it.

A plain prompt whose exact plan ran on the decode engine leaves its KV there under the tenant's
exact salt (vLLM's prefix cache, whole blocks; the reference engine's held prefixes). A growing
conversation's next turn starts with all of it. The tier may not hold it yet (its store runs
behind, :mod:`cluster.control.store_behind`), and prompt matching may find a chunk further in
(a catalogue seen in earlier turns): an approximate plan is then salted by its recipe
(``RequestPlan.kv_salt``), vLLM's exact blocks are not looked up, and the conversation reuses less
than plain vLLM would. So the router keeps, per tenant, the last exact prompts it ran (a bounded
LRU: a hint, never a promise; the decode worker's ``expect`` answer says what it holds when the
request runs), and the planner prefers the exact prefix they give when it reuses at least as
much as the approximate plan (:func:`prefer_exact`): the longest exact prefix first, from the
tier or the decode engine's own cache.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from kvruntime.messages.plan import PlanKind, RequestPlan


class DecodeHeld:
    def __init__(self, per_tenant: int = 16, tenants: int = 1024):
        if per_tenant < 1 or tenants < 1:
            raise ValueError("decode held hint: per_tenant >= 1 and tenants >= 1")
        self.per_tenant, self.tenants = per_tenant, tenants
        self._by: OrderedDict[str, OrderedDict[int, np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()

    def note(self, tenant: str, ids) -> None:
        """An exact plan of ``ids`` (prefix and suffix) ran on the decode engine."""
        arr = np.asarray(ids, dtype=np.int64)
        key = hash(arr.tobytes())
        with self._lock:
            mine = self._by.setdefault(tenant, OrderedDict())
            self._by.move_to_end(tenant)
            mine[key] = arr
            mine.move_to_end(key)
            while len(mine) > self.per_tenant:
                mine.popitem(last=False)
            while len(self._by) > self.tenants:
                self._by.popitem(last=False)

    def longest(self, tenant: str, ids) -> int:
        """Leading tokens of ``ids`` one of the tenant's last exact prompts shares."""
        arr = np.asarray(ids, dtype=np.int64)
        with self._lock:
            held = list(self._by.get(tenant, {}).values())
        best = 0
        for h in held:
            n = min(len(h), len(arr))
            diff = np.flatnonzero(h[:n] != arr[:n])
            best = max(best, int(diff[0]) if len(diff) else n)
        return best


def sourced(plan: RequestPlan) -> int:
    """Prefix tokens ``plan`` takes from KV rather than computing in context: its reuse,
    reposition and edit steps whole (a span compiled in this request's build counts: the plan
    makes it reusable)."""
    return sum(s.tokens for s in plan.steps if s.kind not in (PlanKind.RECOMPUTE, PlanKind.ERRATUM))


def prefer_exact(plan: RequestPlan, held: int, hit: int) -> bool:
    """Whether an approximate ``plan`` gives way to the exact prefix of ``held`` tokens the decode
    engine holds (``hit``: the exact prefix the tier holds, already in the plan): when that prefix
    is longer than the tier's and covers at least as many tokens as the plan takes from KV."""
    return bool(plan.approx) and held > hit and held >= sourced(plan)
