"""Reference engine: torch + transformers with explicit per-layer KV, CPU or CUDA.

``prefill(token_ids, positions, past)`` runs the model over new tokens at *arbitrary* RoPE
positions against an *arbitrary* past :class:`~kvruntime.kv.KVCache` (slots in any order), with
an explicit additive mask built from positions (causal: key position <= query position; sliding
layers also key position > query position - window). That single primitive is what every KV
operation needs: chunk precompile, seam repair, erratum prefill, selective recompute, decode.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from kvruntime.buckets import bucket_for, length_masks, pad_step
from kvruntime.checkpoint import ensure_checkpoint
from kvruntime.config.choices import ForwardShapes
from kvruntime.decode_cache import DecodeSession
from kvruntime.hf_models import ModelRefused, arch_info, describe
from kvruntime.inplace import (Cancelled, SlotCache, StopForward, recording_active, register,  # noqa: F401
                               tail_is_causal)  # (Cancelled re-exported)
from kvruntime.kv import KVBuffer, KVCache
from kvruntime.models import ModelSpec, get_model_spec
from kvruntime.rope import RopeTable, self_test
from kvruntime.rope_config import rope_frequencies

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PrefillOutput:
    logits: torch.Tensor | None  # [vocab] fp32 logits after the last new token (None if not asked)
    kv: KVCache                  # KV of the new tokens only, at the given positions


class ReferenceEngine:
    """Owns one loaded model. Not thread-safe for concurrent forwards; a lock serialises them."""

    def __init__(self, model: str | ModelSpec = "smollm2-135m", *, dtype: str = "float32",
                 device: str = "cpu", threads: int | None = None, run_self_test: bool = True,
                 shapes: str | ForwardShapes = ForwardShapes.EAGER):
        import transformers

        self.spec = get_model_spec(model) if isinstance(model, str) else model
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available")
        if threads:
            torch.set_num_threads(threads)
        self.dtype_name = dtype
        # few-token forwards (<= 64 new tokens) at static bucket shapes, keys through a length
        # (kvruntime.buckets); eager: every forward at its own shape
        self.shapes = ForwardShapes.of(shapes)
        self.dtype = _DTYPES[dtype]
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # tensors report cuda:N: a bare "cuda" would never compare equal to their device
            self.device = torch.device("cuda", torch.cuda.current_device())
        path = ensure_checkpoint(self.spec)
        # the architecture is read (and refused with one line) before any weight is loaded
        self.arch = arch_info(transformers.AutoConfig.from_pretrained(path))
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        # every layer attends through kvruntime.inplace.attend: SDPA with GQA (or, with soft-capping,
        # transformers' eager arithmetic per kv head), reading K/V in place from the request's buffer
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=self.dtype, attn_implementation=register()).to(self.device).eval()
        a = self.arch
        self.num_layers: int = a.num_layers
        self.kv_heads: int = a.kv_heads
        self.head_dim: int = a.head_dim
        self.layer_types: list[str] = list(a.layer_types)
        self.sliding_window: int | None = a.sliding_window
        self.context_window: int = min(self.spec.context_window, a.context_window)
        # tier keys name the weights, not only the model: a checkpoint directory's name carries its
        # content hash; a shipped model's converted checkpoint is named after its GGUF's SHA-256
        self.model_id: str = self.spec.name if self.spec.checkpoint else path.name
        self.bos_id: int | None = self.tokenizer.bos_token_id
        self.eos_ids: set[int] = self._eos_ids()
        self.rope = RopeTable.from_model(self.model)
        want = rope_frequencies(self.model.config).inv_freq
        # within float32 rounding: a model built on a GPU computes its frequencies there (last-ulp
        # differences from the CPU's), a custom RoPE differs by far more
        if want.shape != self.rope.inv_freq.shape or not torch.allclose(want, self.rope.inv_freq, rtol=1e-6, atol=0):
            raise ModelRefused(f"model {self.spec.name}: its rotary module's frequencies differ from those "
                               "derived from config.json (a custom RoPE); re-rotation cannot be trusted")
        log.info("%s", describe(self.spec, a))
        self._lock = threading.RLock()
        # KV bytes copied out of a caller's context into a buffer with room (prefill's past, generate's
        # context, room_for): 0 on the in-place paths (a KVBuffer with room)
        self.copied_bytes = 0
        if run_self_test:
            # below the window: dynamic / longrope frequencies are only static there (rope_config)
            self_test(self, self.rope, target=min(3001, self.context_window - 64))
        else:
            self.rope.enabled = False  # never trust an unchecked rotation

    # ---- tokens ---------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with no special tokens added (pieces are joined by ids)."""
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _eos_ids(self) -> set[int]:
        from kvruntime.hf_models import eos_token_ids
        return eos_token_ids(self.tokenizer, getattr(self.model, "generation_config", None))

    # ---- KV helpers ------------------------------------------------------------------------
    def empty_kv(self) -> KVCache:
        return KVCache.empty(self.num_layers, self.kv_heads, self.head_dim, self.dtype, self.device)

    def _mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor):
        """Additive masks [1, 1, q, k] by position: one tensor, or a dict per layer type."""
        diff = q_pos[:, None] - k_pos[None, :]                  # [q, k]
        neg = torch.finfo(self.dtype).min
        causal = diff >= 0
        masks = {}
        for lt in set(self.layer_types):
            allowed = causal & (diff < self.sliding_window) if lt == "sliding_attention" else causal
            m = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
            m.masked_fill_(~allowed, neg)
            masks[lt] = m[None, None]
        if len(masks) == 1 and ("full_attention" in masks or not self.arch.per_layer_masks):
            return next(iter(masks.values()))    # one mask for all layers (Mistral, Phi-3: all sliding)
        return masks

    # ---- the primitive ---------------------------------------------------------------------
    @torch.inference_mode()
    def write(self, data: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor, slots, keys: int, *,
              logits: bool = False, stop_layer: int | None = None, cancelled=None) -> torch.Tensor | None:
        """Run the tokens ``token_ids[slots]`` at ``positions[slots]`` through the model; every layer
        writes their K/V into ``data[layer, :, :, slots]`` (the request's buffer, [layers, 2,
        kv_heads, capacity, head_dim]) and attends to slots ``[0, keys)`` -- the new ones included
        -- by position (causal; sliding layers within the window). Nothing else is copied.

        ``slots``: a ``slice`` (a block) or a LongTensor of slot indices (seams, selected tokens).
        A block at the end of position-ordered contiguous slots (the question, an erratum, a
        chunk of a prefill) runs with no mask but lower-right causality; anything else with the
        additive [q x keys] mask by position. ``stop_layer=i``: stop once layer i has written its
        K/V (a probe; later layers' slots are left as they were). ``cancelled``: checked before
        each layer, True raises :class:`Cancelled`. Returns the last new token's fp32 logits
        when ``logits`` (``"all"``: every new token's, [q, vocab], at the forward's own shape).
        Cost: O(q * keys) attention + O(q) MLP per layer for q new tokens."""
        if isinstance(slots, slice):
            idx = torch.arange(slots.start, slots.stop, device=self.device)
        else:
            idx = slots = torch.as_tensor(slots, dtype=torch.long, device=self.device)
        q = idx.numel()
        if q == 0 or keys > data.shape[3] or int(idx.max()) >= keys or int(idx.min()) < 0:
            raise ValueError(f"slots must be non-empty and inside the {keys} attended slots")
        ids, pos = token_ids[idx].to(self.device), positions[idx].to(self.device)
        if bool((pos < 0).any()):
            raise ValueError("positions must be >= 0")
        bucket = bucket_for(q) if self.shapes is ForwardShapes.BUCKETED and not recording_active() else None
        if bucket is not None and logits != "all":
            return self.write_padded(data, positions, idx, ids, pos, keys, bucket, logits=logits,
                                     stop_layer=stop_layer, cancelled=cancelled)
        block = isinstance(slots, slice) and slots.stop == keys
        mask = None if block and tail_is_causal(positions, slots.start, keys) \
            else self._mask(pos, positions[:keys].to(self.device))
        cache = SlotCache(data, slots, keys, stop_layer=stop_layer, cancelled=cancelled)
        out = None
        with self._lock:
            try:
                out = self.model(input_ids=ids[None], position_ids=pos[None], attention_mask=mask,
                                 past_key_values=cache, use_cache=True, logits_to_keep=0 if logits == "all" else 1)
            except StopForward:
                pass
        if logits == "all" and out is not None:      # every new token's row, [q, vocab] (prompt log-probs)
            return out.logits[0].float()
        return out.logits[0, -1].float() if (logits and out is not None) else None

    @torch.inference_mode()
    def write_padded(self, data, positions, idx, ids, pos, keys: int, bucket: int, *, span: int | None = None,
                     logits: bool = False, stop_layer: int | None = None, cancelled=None):
        """:meth:`write` of the q real tokens (slots ``idx``, ids, positions) at ``bucket``'s shape
        (:mod:`kvruntime.buckets`): pads run but are never written nor attended; every layer reads
        ``span`` slots (default ``keys``; a graph would read the whole buffer) masked by the key
        length ``keys`` and by position. Returns the last real token's fp32 logits when ``logits``."""
        span = keys if span is None else span
        if not keys <= span <= min(data.shape[3], positions.shape[0]):
            raise ValueError(f"span must hold the {keys} attended slots and fit the buffer, got {span}")
        step = pad_step(idx, ids, pos, keys, bucket)
        mask = length_masks(step, positions[:span].to(self.device), self.layer_types, self.sliding_window,
                            self.dtype, self.arch.per_layer_masks)
        cache = SlotCache(data, step.slots, span, stop_layer=stop_layer, cancelled=cancelled, src=step.src)
        out = None
        with self._lock:
            try:
                out = self.model(input_ids=step.ids[None], position_ids=step.pos[None], attention_mask=mask,
                                 past_key_values=cache, use_cache=True, logits_to_keep=step.last)
            except StopForward:
                pass
        return out.logits[0, -1].float() if (logits and out is not None) else None

    @torch.inference_mode()
    def prefill(self, token_ids, positions, past: KVCache | KVBuffer | None = None, *, logits: bool = False,
                stop_after_layer: int | None = None, cancelled=None) -> PrefillOutput:
        """Run ``token_ids`` ([n]) at ``positions`` ([n] int64) attending to ``past`` + themselves.

        Returns the new tokens' KV (and the last token's logits if ``logits``). ``past`` a
        :class:`~kvruntime.kv.KVBuffer` with room for the n tokens (the buffer the prefix was built
        or received in, allocated with room): the forward writes their K/V into its next slots
        and attends to the prefix there -- nothing is copied; they are committed (its
        :meth:`~kvruntime.kv.KVBuffer.view` is then the prefix and them) and the returned KV is
        views of those slots. ``past`` a :class:`KVCache` (or None): the convenience path, ``past``
        copied once into a new buffer with room (:meth:`room_for`, counted in :attr:`copied_bytes`)
        and the new tokens' KV returned as their own tensor.
        With ``stop_after_layer=i`` the forward stops once layer i has its K/V and only layers
        0..i of the returned KV are meaningful (the rest are zeros): a cheap probe.
        ``cancelled``: a callable checked before each layer; when it returns True the forward stops
        and :class:`Cancelled` is raised. Cost: O(n * (len(past) + n)) attention per layer plus O(n) MLP per layer.
        """
        ids = torch.as_tensor(list(token_ids) if not torch.is_tensor(token_ids) else token_ids,
                              dtype=torch.long, device=self.device)
        pos = torch.as_tensor(positions, dtype=torch.long, device=self.device)
        if ids.dim() != 1 or pos.shape != ids.shape or ids.numel() == 0:
            raise ValueError(f"need 1-D token_ids and positions of equal non-zero length, got "
                             f"{tuple(ids.shape)} and {tuple(pos.shape)}")
        if bool((pos < 0).any()):
            raise ValueError("positions must be >= 0")
        n = ids.numel()
        owned = isinstance(past, KVBuffer)
        buf = past if owned else self.room_for(past if past is not None else self.empty_kv(), n)
        self._check_buffer(buf, n)
        p = buf.length
        new = buf.slot(n)
        if stop_after_layer is not None:     # a probe leaves later layers unwritten: documented as zeros
            new[stop_after_layer + 1:].zero_()
        buf.positions[p:p + n], buf.token_ids[p:p + n] = pos, ids
        last = self.write(buf.data, buf.positions, buf.token_ids, slice(p, p + n), p + n, logits=logits,
                          stop_layer=stop_after_layer, cancelled=cancelled)
        kv = buf.commit(pos, ids).slice(p)
        if not owned and p:                  # not a view pinning the copied past
            kv = KVCache(kv.data.clone(), kv.positions.clone(), kv.token_ids.clone())
        return PrefillOutput(last, kv)

    def room_for(self, kv: KVCache, room: int) -> KVBuffer:
        """A new buffer (the engine's dtype and device) holding ``kv``, copied once (its bytes
        counted in :attr:`copied_bytes`), with ``room`` more slots: for KV that has no room after
        it, or whose memory must stay untouched (a tier's stored context, a cached old version)."""
        if room < 0:
            raise ValueError(f"room must be >= 0, got {room}")
        data = torch.empty(self.num_layers, 2, self.kv_heads, kv.num_tokens + room, self.head_dim,
                           dtype=self.dtype, device=self.device)
        buf = KVBuffer(data)
        if kv.num_tokens:
            buf.append(kv)
            with self._lock:
                self.copied_bytes += data[:, :, :, :kv.num_tokens].numel() * data.element_size()
        return buf

    def _check_buffer(self, buf: KVBuffer, n: int) -> None:
        want = (self.num_layers, 2, self.kv_heads)
        if tuple(buf.data.shape[:3]) != want or buf.data.shape[4] != self.head_dim \
                or buf.data.dtype != self.dtype or buf.data.device != self.device:
            raise ValueError(f"a KV buffer must be [{self.num_layers}, 2, {self.kv_heads}, slots, {self.head_dim}] "
                             f"{self.dtype} on {self.device}, got {tuple(buf.data.shape)} {buf.data.dtype} "
                             f"on {buf.data.device}")
        if buf.length + n > buf.capacity:
            raise ValueError(f"{n} new tokens do not fit the buffer's room ({buf.length} of {buf.capacity} written)")

    # ---- decoding --------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, kv: KVCache | KVBuffer, first_logits: torch.Tensor, max_tokens: int, *,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 stop_at_eos: bool = True):
        """Decode up to ``max_tokens`` after a context ``kv`` whose next-token logits are
        ``first_logits``. Greedy when ``temperature == 0``. Yields token ids one by one.
        Cost per token: one single-token forward over the whole context, whose KV sits in a
        buffer allocated once (:class:`~kvruntime.decode_cache.DecodeSession`): nothing is copied
        per token beyond the new token's own KV. ``kv`` a :class:`~kvruntime.kv.KVBuffer` with
        room for ``max_tokens - 1`` more slots: the session adopts it (the generated tokens' K/V
        go into its room, not committed) and the context is not copied; else it is copied once
        (counted in :attr:`copied_bytes`).
        """
        if max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if temperature < 0 or not (0 < top_p <= 1):
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        gen = torch.Generator(device="cpu")
        if seed is not None:
            gen.manual_seed(seed)
        logits = first_logits
        buffer = kv.data if isinstance(kv, KVBuffer) else None
        session = DecodeSession(self, kv.view() if buffer is not None else kv, max(max_tokens - 1, 0), buffer=buffer)
        with self._lock:
            self.copied_bytes += session.copied_bytes
        for i in range(max_tokens):
            tok = _pick(logits, temperature, top_p, gen)
            yield tok
            if (stop_at_eos and tok in self.eos_ids) or i == max_tokens - 1:
                return
            logits = session.step([tok], [session.next_position])

    def continue_greedy(self, ctx: KVCache | KVBuffer, suffix_ids, n: int, *,
                        stop_at_eos: bool = True) -> tuple[torch.Tensor, list[int]]:
        """``suffix_ids`` run after ``ctx`` (at the positions after its last), then up to ``n``
        greedy tokens: (the logits after the suffix, the tokens). ``ctx`` a
        :class:`~kvruntime.kv.KVBuffer` with room for the suffix and ``n - 1`` tokens: all of it
        runs in that buffer, in place (the suffix committed); else ``ctx`` is copied once into a
        buffer with that room (counted in :attr:`copied_bytes`)."""
        ids = [int(t) for t in suffix_ids]
        if not ids:
            raise ValueError("continue_greedy needs a non-empty suffix")
        room = len(ids) + max(n - 1, 0)
        buf = ctx if isinstance(ctx, KVBuffer) and ctx.capacity - ctx.length >= room \
            else self.room_for(ctx.view() if isinstance(ctx, KVBuffer) else ctx, room)
        start = int(buf.positions[buf.length - 1]) + 1 if buf.length else 0
        out = self.prefill(ids, torch.arange(start, start + len(ids)), buf, logits=True)
        return out.logits, self.greedy(buf, out.logits, n, stop_at_eos=stop_at_eos)

    def greedy(self, kv: KVCache | KVBuffer, first_logits: torch.Tensor, n: int, stop_at_eos: bool = False) -> list[int]:
        return list(self.generate(kv, first_logits, n, stop_at_eos=stop_at_eos))


def _pick(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> int:
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    if top_p < 1:
        sp, si = torch.sort(probs, descending=True)
        keep = torch.cumsum(sp, 0) - sp < top_p
        probs = torch.zeros_like(probs).scatter(0, si[keep], sp[keep])
        probs /= probs.sum()
    return int(torch.multinomial(probs, 1, generator=gen))
