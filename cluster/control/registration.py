"""Registration of skills and memories: tokenised, precompiled on a prefill worker (and its
variant after the model's chat frame), recorded in the state store; deleted and evicted; listed
with their in-tier status. Templates are text only (``Registry.add_template``, no KV)."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Callable

from cluster.control.errors import RequestError
from cluster.control.metrics import Metrics
from cluster.control.planner import RenderedSegment, frame_variant
from cluster.control.pricing import TokenBudget
from cluster.control.render import Renderer
from cluster.control.router_sections import LimitsSection
from cluster.control.routing import NoLiveWorker
from cluster.control.state import Registration
from kvruntime.messages.keys import token_hash
from kvruntime.messages.plan import KVRef

if TYPE_CHECKING:
    from cluster.control.backends import Backends
    from cluster.control.tier_lookup import TierLookup

log = logging.getLogger(__name__)
FRAME_SLACK = 16      # tokens a registered chunk leaves in the window for the frame and a question


class Registrations:
    def __init__(self, backends: "Backends", renderer: Renderer, metrics: Metrics, lookup: "TierLookup",
                 limits: LimitsSection, salt: Callable[[str], str]):
        self.backends, self.renderer, self.metrics, self.lookup = backends, renderer, metrics, lookup
        self.registry = renderer.registry
        self.limits, self.salt = limits, salt

    def _tokens(self, kind: str, text: str) -> None:
        """400 unless ``text`` is non-empty and can fit the window (checked before tokenising)."""
        if not isinstance(text, str) or not text.strip():
            raise RequestError(400, f"{kind} text must be a non-empty string", param="text")
        window = self.limits.context_window
        low = TokenBudget(window, FRAME_SLACK, self.renderer.max_chars).lower_bound(len(text.strip()))
        if low + FRAME_SLACK > window:          # cannot fit: refused before it is tokenised
            raise RequestError(400, f"{kind} is at least {low} tokens ({len(text)} characters); the model's window "
                                    f"is {window}")

    async def register_chunk(self, kind: str, tenant: str, name: str, text: str) -> dict:
        self._tokens(kind, text)
        ids = await asyncio.to_thread(self.renderer.chunk_ids, text)     # tokenize off the event loop
        if len(ids) + FRAME_SLACK > self.limits.context_window:
            raise RequestError(400, f"{kind} is {len(ids)} tokens; the model's window is {self.limits.context_window}")
        ref = self.renderer.chunk_ref(ids, self.salt(tenant))
        try:
            first = self.backends.view.pick_prefill(None)
        except NoLiveWorker:
            first = 0              # the view may be stale: precompile still tries every actor
        info = await self.backends.precompile(ref, first)
        now = time.time()
        old = self.registry.state.get_registration(tenant, kind, name)
        self.registry.add_chunk(Registration(tenant, kind, name, text, ids, token_hash(ids), ref.digest,
                                             old.created if old else now, now, True))
        self.metrics.registrations.labels(kind, "cached" if info.cached else "compiled").inc()
        out = {"name": name, "kind": kind, "tokens": len(ids), "key": ref.digest, "cached": info.cached,
               "bytes": info.bytes, "seconds": info.seconds, "worker": info.worker}
        variant = self.frame_variant(kind, name, ids, ref)
        if variant is not None:          # the first request after the default frame pays no compile
            got = await self._precompile_variant(kind, name, ids, variant, first)
            if got is not None:
                out["frame_variant"] = got
        return out

    async def _precompile_variant(self, kind: str, name: str, ids, variant: KVRef, first: int) -> dict | None:
        try:
            v = await self.backends.precompile(variant, first)
        except Exception as exc:     # registered all the same: the variant compiles on first use
            self.metrics.record_fallback("frame_variant_precompile_failed")
            log.warning("precompiling %s %r after the chat frame failed (%s): compiled on first use", kind, name, exc)
            return None
        if not v.cached:
            self.metrics.chunk_variants.inc()
            log.info("%s %r precompiled after the %d-token chat frame (%d tokens, %.3f s)", kind, name,
                     len(variant.token_ids) - len(ids), len(variant.token_ids), v.seconds)
        return {"key": variant.digest, "cached": v.cached, "seconds": v.seconds}

    def frame_variant(self, kind: str, name: str, ids: tuple[int, ...], ref: KVRef) -> KVRef | None:
        """The chunk's variant after this model's default chat frame (None: the model has none)."""
        if not self.renderer.spec.chat_user_prefix or not self.renderer.frame():
            return None
        return frame_variant((RenderedSegment("frame", None, self.renderer.frame()),
                              RenderedSegment(kind, name, tuple(ids), kv=ref)))

    async def delete_chunk(self, kind: str, tenant: str, name: str) -> dict:
        c = self.registry.remove_chunk(tenant, kind, name)
        shared = any(o.key == c.key for k in ("skill", "memory") for o in self.registry.chunks(tenant, k))
        ref = self.renderer.chunk_ref(c.token_ids, self.salt(tenant))
        evicted = False if shared else await self.backends.evict(ref)
        variant = None if shared else self.frame_variant(kind, name, c.token_ids, ref)
        if variant is not None:
            await self.backends.evict(variant)
        return {"name": name, "kind": kind, "deleted": True, "evicted": evicted}

    async def listing(self, kind: str, tenant: str) -> list[dict]:
        """Registrations with their in-tier status, looked up now (counted as tier lookups)."""
        regs = self.registry.chunks(tenant, kind)
        refs = [self.renderer.chunk_ref(r.token_ids, self.salt(tenant)) for r in regs]
        present = await self.lookup.present(refs)
        out = []
        for r, ref in zip(regs, refs):
            in_tier = ref.digest in present
            if in_tier != r.in_tier:
                self.registry.state.mark_used(tenant, kind, r.name, r.last_used, in_tier)
            out.append({"name": r.name, "tokens": len(r.token_ids), "key": r.key, "in_tier": in_tier,
                        "created": r.created, "last_used": r.last_used})
        return out
