"""The prefix a chunk is compiled after (its *frame*), and its content address.

A chunk's KV depends on everything before it. Compiled after BOS alone (the default anchor,
``compose.default_prefix``) it sees a context it never sees at use time; compiled after the
prefix it will follow -- by default the model's chat frame up to the first segment (BOS, system
prompt, user-turn opener) -- the first chunk after that frame is exact reuse, and later chunks
start from the right attention sinks. APE's generic alternative for base models without a
frame is a few newlines after BOS (:func:`newline_prefix`).

The prefix is part of the chunk's identity: :func:`prefix_hash` goes into its tier key
(``ChunkKey.prefix``), "" for the default anchor so BOS-compiled keys stay what they were.
"""
from __future__ import annotations

from kvruntime.messages.keys import prefix_hash  # noqa: F401 (re-exported)

COMPILE_MODES = ("bos", "frame", "nl")   # nl<k>: BOS + k newlines (APE), e.g. "nl4"


def chat_frame(engine) -> list[int]:
    """``engine``'s chat frame (:meth:`kvruntime.model_spec.ModelSpec.chat_frame`): BOS where the
    model uses one + the user-turn opener, up to the first segment."""
    return engine.spec.chat_frame(engine.bos_id, engine.encode)


def newline_prefix(engine, k: int) -> list[int]:
    """APE's generic shared prefix: BOS (if any) + ``k`` newline characters."""
    if k <= 0:
        raise ValueError(f"newline prefix needs k >= 1, got {k}")
    bos = [] if engine.bos_id is None else [engine.bos_id]
    return bos + engine.encode("\n" * k)


def compile_prefix(engine, mode: str) -> list[int] | None:
    """The prefix of a compile ``mode``: "bos" -> None (the default anchor), "frame" ->
    :func:`chat_frame`, "nl<k>" -> :func:`newline_prefix`. ValueError for anything else."""
    if mode == "bos":
        return None
    if mode == "frame":
        return chat_frame(engine)
    if mode.startswith("nl") and mode[2:].isdigit():
        return newline_prefix(engine, int(mode[2:]))
    raise ValueError(f"compile mode must be 'bos', 'frame' or 'nl<k>', got {mode!r}")
