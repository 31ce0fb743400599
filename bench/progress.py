"""One progress bar for every benchmark's outer loop (stderr, so the tables on stdout stay clean)."""
from __future__ import annotations

import sys


def progress(items, desc: str):
    """``items`` with a tqdm bar on stderr (each step of a benchmark can take minutes)."""
    from tqdm import tqdm
    return tqdm(list(items), desc=desc, file=sys.stderr, unit="step", dynamic_ncols=True)
