"""The KV operations a plan is made of. Each is a plain function over :class:`KVCache`
whose docstring states its cost (n = tokens touched, P = tokens attended to, L = layers).

- ``compose``: precompile a chunk at its canonical position, reposition (re-rotate keys by a
  delta), seam repair, and the left-to-right composition of a context from segments.
- ``build`` + ``interpret``: the one builder of a context's KV (one buffer, each slot written once)
  and the one interpreter of its steps over it (``compose`` and the prefill executor both run it).
- ``frame``: the prefix a chunk is compiled after (BOS anchor, the chat frame, APE newlines).
- ``blend``: selective recompute of composed chunks (CacheBlend): probe, pick the tokens that
  deviate most, recompute them against the whole context.
- ``qselect``: the same, with the tokens picked by the question's attention to them.
- ``edit``: erratum (append-only correction) and edit-in-place (field + top-K downstream).
- ``recompute``: full prefill, the oracle.
"""
from kvruntime.ops.compose import (ChunkSegment, ComposeResult, TextSegment, compose, naive_splice,
                                   precompile_chunk, reposition, seam_repair)
from kvruntime.ops.blend import BlendResult, blend_count, selective_recompute
from kvruntime.ops.edit import EditResult, ErratumResult, edit_in_place, erratum
from kvruntime.ops.recompute import recompute

__all__ = ["ChunkSegment", "ComposeResult", "TextSegment", "compose", "naive_splice", "precompile_chunk",
           "reposition", "seam_repair", "BlendResult", "blend_count", "selective_recompute", "EditResult", "ErratumResult", "edit_in_place",
           "erratum", "recompute"]
