"""Names of the question-guided probes (``q<last|late|N>[-g<k>]``), shared by the selective
recompute (:mod:`kvruntime.ops.blend`) and the question scorer (:mod:`kvruntime.ops.qselect`)."""
from __future__ import annotations

import re

_PROBE = re.compile(r"^q(last|late|\d+)(?:-g(\d+))?$")


def is_question_probe(probe) -> bool:
    return isinstance(probe, str) and probe.startswith("q") and bool(_PROBE.match(probe))


def question_layers(probe: str, num_layers: int) -> tuple[tuple[int, ...], int]:
    """(layers scored, grouping radius) of a question probe; ValueError if malformed."""
    m = _PROBE.match(probe or "")
    if not m:
        raise ValueError(f"question probe must be 'q<last|late|N>[-g<k>]', got {probe!r}")
    which, group = m.group(1), int(m.group(2) or 0)
    if which == "last":
        layers = (num_layers - 1,)
    elif which == "late":
        layers = tuple(range(num_layers - max(1, num_layers // 4), num_layers))
    else:
        if not 0 <= int(which) < num_layers:
            raise ValueError(f"question probe layer must be in [0, {num_layers - 1}], got {which}")
        layers = (int(which),)
    if group > 8:
        raise ValueError(f"grouping radius must be <= 8, got {group}")
    return layers, group
