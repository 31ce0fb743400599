"""What a prefill worker reports back to the router after executing a plan's prefix steps."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvruntime.messages.decode import TokenLogprob
    from kvruntime.messages.plan import KVRef, RequestPlan
    from kvruntime.messages.transfer import KVEndpoint


@dataclass
class PrefillStats:
    computed: int = 0                 # tokens through a forward pass
    reused: int = 0                   # tokens loaded exactly (reuse)
    repositioned: int = 0             # tokens loaded and re-rotated
    erratum: int = 0                  # erratum tokens computed
    tier_lookups: int = 0
    tier_hits: int = 0
    rewarmed: int = 0                 # chunks missing from this worker's tier, recomputed and stored back
    variants_compiled: int = 0        # chunks compiled after a frame on first use (exact reuse) and stored
    not_sent: int = 0                 # leading prefix tokens not shipped: the decode engine held them
    fallbacks: list[str] = field(default_factory=list)   # reasons, one per fallback taken
    stages: dict[str, float] = field(default_factory=dict)  # KV path stage -> seconds (transfer.STAGES)
    # plan.prompt_logprobs: prefix tokens 1.. and the suffix's first, each given the tokens before it
    prompt_logprobs: list["TokenLogprob"] = field(default_factory=list)


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    transfer_id: str
    prefix_tokens: int
    seconds: float                    # building the prefix KV
    transfer_bytes: int
    transfer_seconds: float
    stats: PrefillStats
    transferred: bool                 # False: the decode worker must recompute (reason in stats.fallbacks)
    stored: bool = False              # the prefix KV was stored in the tier under the requested ref
    transport: str = ""               # the transport that carried the block (nixl | grpc; "" if none)


@dataclass(frozen=True)
class PrecompileInfo:
    """Result of registering one chunk on a prefill worker."""
    cached: bool                      # True: the tier already held this content (no prefill ran)
    bytes: int                        # KV bytes stored (0 when cached)
    seconds: float                    # wall time on the worker
    worker: str                       # which prefill worker answered
    start: int = 0                    # tokens continued from a stored prefix's KV (store-behind's delta; 0: from 0)


REPORT_TTL_S = 5.0      # a replica's queue report older than this counts no more (gone, or its probes stopped)


@dataclass(frozen=True)
class QueueReport:
    """Router replica -> prefill worker, with each health probe and each admission exchange
    (``cluster.control.exchange``): this replica's admission queue."""
    replica: str          # the replica's process name (e.g. ``router-<id>``)
    queued: int           # requests admitted and not yet at their first token
    seq: int = 0          # the replica's report counter: reports travel on several paths, a worker keeps the newest
    ttft_p50_s: float = 0.0   # the replica's own unloaded TTFT median, seconds (0: not yet measured)
    ttft_p90_s: float = 0.0   # its p90 (a replica that has measured none yet takes the others')

    def __post_init__(self):
        if not self.replica or not isinstance(self.queued, int) or self.queued < 0 \
                or not isinstance(self.seq, int) or self.seq < 0 \
                or not 0 <= self.ttft_p50_s <= self.ttft_p90_s or self.ttft_p90_s != self.ttft_p90_s:
            raise ValueError(f"a queue report needs a replica id, a queued count >= 0, a seq >= 0 and "
                             f"0 <= ttft_p50_s <= ttft_p90_s, got {self!r}")


@dataclass(frozen=True)
class PrefillJob:
    """Router -> prefill worker (``PrefillWorker.execute``): build one plan's prefix KV and push
    it to the decode worker that expects it."""
    plan: "RequestPlan"
    transfer_id: str                   # <request id>-<8 hex>: the grant the decode worker holds
    credential: str                    # the transfer's credential (the grant holds its SHA-256 only)
    store_as: "KVRef | None" = None    # store the built prefix in the tier under this key (None: don't)
    send_from: int = 0                 # leading prefix tokens not to send (ExpectReply.held)
    decode: "KVEndpoint | None" = None  # where to push (filled by the backends from the decode index)
