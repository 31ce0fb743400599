"""What the control plane needs from the workers, as a protocol: the router and
:mod:`cluster.control.lifecycle` talk to prefill and decode workers only through it. Production
implements it with Ray actor handles (:class:`cluster.control.ray_backends.RayBackends`); unit tests
implement it in process. Every value crossing it is a message from ``kvruntime.messages``."""
from __future__ import annotations

from typing import AsyncIterator, Protocol

from kvruntime.messages.decode import SamplingParams, TokenEvent, DecodeSummary
from kvruntime.messages.plan import KVRef, RequestPlan
from kvruntime.messages.prefill import PrecompileInfo, PrefillResult
from kvruntime.messages.transfer import TransferGrant


class Backends(Protocol):
    num_prefill: int
    num_decode: int

    async def contains(self, refs: list[KVRef], index: int = 0) -> list[bool]: ...
    async def precompile(self, ref: KVRef, index: int = 0) -> PrecompileInfo: ...
    async def evict(self, ref: KVRef) -> bool: ...
    # -> held leading prefix tokens; when they reach ``computes_from`` (plan.decode_computes_rest)
    # no block is expected and ``decode`` computes the rest of the prefix itself
    async def expect(self, decode_index: int, grant: TransferGrant, prefix: tuple[int, ...], salt: str,
                     computes_from: int | None = None) -> int: ...
    async def prefill(self, index: int, plan: RequestPlan, decode_index: int, transfer_id: str,
                      store_as: KVRef | None, *, credential: str, send_from: int = 0) -> PrefillResult: ...
    async def shadow(self, index: int, plan: RequestPlan): ...   # -> messages.fidelity.ShadowResult
    def decode(self, index: int, transfer_id: str | None, prefix: tuple[int, ...], suffix: tuple[int, ...],
               sampling: SamplingParams, salt: str) -> AsyncIterator[TokenEvent | DecodeSummary]: ...
    # Optional (cluster.control.ray_backends): ``view`` (routing.WorkerView), ``fault_policy``
    # (routing.FaultPolicy), ``start_health(metrics)``, ``cancel(index, key)`` with
    # ``decode(..., cancel_key=key)``, ``decode(..., continuation=messages.decode.Continuation)``
    # (cluster.control.migration) and ``cancel_prefill(index, transfer_id)``. Worker deaths are
    # raised as routing.WorkerLost.
