"""OpenAI's log-prob shapes, as vLLM serves them, from :class:`TokenEvent` values: chat's
``logprobs.content`` entries; completions' parallel lists ``tokens`` / ``token_logprobs`` /
``top_logprobs`` / ``text_offset``, where ``top_logprobs`` holds the chosen token and the top
``k`` (up to ``k + 1`` entries, as OpenAI's legacy API and vLLM) and ``text_offset`` is each
token's character offset in the choice's text. With ``echo`` the prompt's tokens come first (the
prefill worker's rows, :class:`TokenLogprob`), the first with ``null`` log-probs: nothing precedes
it. A log-prob of ``-inf`` is written as -9999.0 (vLLM's floor: JSON has no infinity)."""
from __future__ import annotations

from kvruntime.messages.decode import TokenEvent, TokenLogprob

FLOOR = -9999.0


def _lp(v: float) -> float:
    return max(v, FLOOR)


class Logprobs:
    def __init__(self, tok, chat: bool):
        self.tok, self.chat = tok, chat

    def _t(self, i: int) -> str:
        return self.tok.decode([i])

    def _top(self, token_id: int, logprob: float, top) -> dict[str, float]:
        return {self._t(token_id): _lp(logprob), **{self._t(i): _lp(v) for i, v in top}}

    def of(self, evs: list[TokenEvent], *, prompt: tuple | None = None, offset: int = 0) -> dict | None:
        """``evs``' log-probs (None when none carries one); completions: ``prompt`` = (its token ids,
        its :class:`TokenLogprob` for tokens 1..) puts the prompt first (echo), ``offset`` = the
        characters of the choice's text before the first token (a streamed chunk's)."""
        evs = [e for e in evs if e.logprob is not None]
        if not evs and prompt is None:
            return None
        if self.chat:
            return {"content": [{"token": self._t(e.token_id), "logprob": _lp(e.logprob),
                                 "bytes": list(self._t(e.token_id).encode()),
                                 "top_logprobs": [{"token": self._t(i), "logprob": _lp(lp),
                                                   "bytes": list(self._t(i).encode())} for i, lp in e.top_logprobs]}
                                for e in evs]}
        rows = self.prompt_rows(*prompt) if prompt is not None else []
        rows += [(self._t(e.token_id), _lp(e.logprob), self._top(e.token_id, e.logprob, e.top_logprobs)) for e in evs]
        offsets, at = [], offset
        for token, _, _ in rows:
            offsets.append(at)
            at += len(token)
        return {"tokens": [r[0] for r in rows], "token_logprobs": [r[1] for r in rows],
                "top_logprobs": [r[2] for r in rows], "text_offset": offsets}

    def prompt_rows(self, ids, scored: tuple[TokenLogprob, ...]) -> list[tuple]:
        """(token, log-prob, top) of each prompt token; the first's are None."""
        if len(scored) != len(ids) - 1 or any(s.token_id != t for s, t in zip(scored, ids[1:])):
            raise RuntimeError(f"the prompt's log-probs came back for {len(scored)} of its {len(ids) - 1} "
                               "scored tokens")
        return [(self._t(ids[0]), None, None)] + [(self._t(s.token_id), _lp(s.logprob),
                                                   self._top(s.token_id, s.logprob, s.top_logprobs)) for s in scored]
