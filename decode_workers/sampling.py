"""Per-request sampling and text for the reference decode engine.

- :class:`Sampler`: logit bias, presence / frequency penalties over the generated tokens, then
  greedy (temperature 0) or temperature + top-p sampling from a generator seeded by the request;
  log-probs (of the model's raw distribution, as vLLM reports by default) when asked.
- :class:`TextStream`: incremental detokenization that never emits half a UTF-8 character (the
  prefix/read offsets of vLLM's ``detokenize_incrementally``), with stop strings held back while
  they may still be forming and trimmed from the output.
"""
from __future__ import annotations

import torch

from kvruntime.messages.decode import SamplingParams


class Sampler:
    def __init__(self, sampling: SamplingParams, vocab: int):
        self.s = sampling
        self.gen = torch.Generator(device="cpu")
        if sampling.seed is not None:
            self.gen.manual_seed(sampling.seed)
        self.counts = torch.zeros(vocab, dtype=torch.float32)
        self.bias = None
        if sampling.logit_bias:
            self.bias = torch.zeros(vocab, dtype=torch.float32)
            for t, b in sampling.logit_bias:
                if t < vocab:
                    self.bias[t] += b

    def pick(self, logits: torch.Tensor) -> tuple[int, float | None, tuple[tuple[int, float], ...]]:
        """(token, its log-prob or None, top log-probs) for next-token ``logits`` ([vocab])."""
        raw = logits.float().cpu()[: self.counts.numel()]
        x = raw
        if self.bias is not None:
            x = x + self.bias
        s = self.s
        if s.presence_penalty or s.frequency_penalty:
            x = x - s.presence_penalty * (self.counts > 0).float() - s.frequency_penalty * self.counts
        if s.temperature == 0:
            tok = int(torch.argmax(x))
        else:
            probs = torch.softmax(x / s.temperature, dim=-1)
            if s.top_p < 1:
                sp, si = torch.sort(probs, descending=True)
                keep = torch.cumsum(sp, 0) - sp < s.top_p
                probs = torch.zeros_like(probs).scatter_(0, si[keep], sp[keep])
                probs = probs / probs.sum()
            tok = int(torch.multinomial(probs, 1, generator=self.gen))
        self.counts[tok] += 1
        if s.logprobs is None:
            return tok, None, ()
        lp = torch.log_softmax(raw, dim=-1)
        top = ()
        if s.logprobs:
            v, i = torch.topk(lp, s.logprobs)
            top = tuple((int(a), float(b)) for a, b in zip(i, v))
        return tok, float(lp[tok]), top


class TextStream:
    """Feed token ids one at a time; get the text each adds, safe to show."""

    def __init__(self, decode, stop: tuple[str, ...] = ()):
        self.decode, self.stop = decode, stop
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.text = ""            # all complete text so far (may end with part of a stop string)
        self.emitted = 0          # characters of ``text`` already returned
        self.stopped = False
        self._hold = max((len(x) for x in stop), default=1) - 1

    def push(self, tok: int) -> str:
        """Text to emit after ``tok`` ("" while a character or a possible stop string is incomplete)."""
        self.ids.append(tok)
        prefix = self.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """At the end: whatever is still held (an incomplete character decodes as U+FFFD)."""
        if not self.stopped and self.read_offset < len(self.ids):
            prefix = self.decode(self.ids[self.prefix_offset:self.read_offset])
            self.text += self.decode(self.ids[self.prefix_offset:])[len(prefix):]
            self.read_offset = len(self.ids)
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        if self.stopped:
            return ""
        found = [at for at in (self.text.find(s, max(0, self.emitted - len(s) + 1)) for s in self.stop) if at >= 0]
        if found:
            self.text, self.stopped = self.text[:min(found)], True
        end = len(self.text) if (final or self.stopped) else max(self.emitted, len(self.text) - self._hold)
        out, self.emitted = self.text[self.emitted:end], max(self.emitted, end)
        return out
