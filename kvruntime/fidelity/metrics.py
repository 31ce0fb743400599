"""Distances between an operation's next-token distribution / greedy output and the oracle's.

Torch is imported only by the two functions that take tensors: the summaries (``summarize``,
``percentile``) are read by ``report`` -> ``profiles`` in the router, which loads no model and
must not pay torch's import (seconds of CPU, hundreds of MB) on every replica start.
"""
from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def kl_divergence(oracle_logits: torch.Tensor, op_logits: torch.Tensor) -> float:
    """KL(P_oracle || P_op) in nats, computed in fp64."""
    import torch.nn.functional as F
    p = F.log_softmax(oracle_logits.double(), -1)
    q = F.log_softmax(op_logits.double(), -1)
    return float((p.exp() * (p - q)).sum().clamp_min(0.0))


def logit_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    import torch.nn.functional as F
    return float(F.cosine_similarity(a.double(), b.double(), dim=0))


def common_prefix_fraction(a: list[int], b: list[int]) -> float:
    n = max(len(a), len(b))
    if n == 0:
        return 1.0
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k / n


def compare(oracle_logits, oracle_greedy, op_logits, op_greedy) -> dict:
    """One case's row: KL, cosine, top-1 agreement, greedy exact / common-prefix fraction."""
    return {
        "kl": kl_divergence(oracle_logits, op_logits),
        "cosine": logit_cosine(oracle_logits, op_logits),
        "top1": float(int(oracle_logits.argmax()) == int(op_logits.argmax())),
        "greedy_exact": float(list(oracle_greedy) == list(op_greedy)),
        "greedy_prefix": common_prefix_fraction(list(oracle_greedy), list(op_greedy)),
    }


def answer_correct(text: str, answers) -> float:
    """1.0 if any accepted answer occurs in ``text`` as a whole word/number (case-insensitive)."""
    low = " ".join(text.lower().split())
    return float(any(re.search(r"(?<![\w.])" + re.escape(a.lower()) + r"(?![\w])", low) for a in answers))


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def summarize(rows: list[dict]) -> dict:
    """Aggregate per-case rows of one operation."""
    def mean(key):
        return sum(r[key] for r in rows) / len(rows) if rows else math.nan
    kls = [r["kl"] for r in rows]
    judged = [r["answer_ok"] for r in rows if r.get("answer_ok") is not None]
    return {
        "answered": len(judged), "accuracy": sum(judged) / len(judged) if judged else math.nan,
        "n": len(rows),
        "kl_mean": mean("kl"), "kl_p10": percentile(kls, 10), "kl_p50": percentile(kls, 50),
        "kl_p90": percentile(kls, 90),
        "cosine_mean": mean("cosine"), "top1": mean("top1"),
        "greedy_exact": mean("greedy_exact"), "greedy_prefix": mean("greedy_prefix"),
        "recomputed_tokens_mean": mean("recomputed_tokens"), "context_tokens_mean": mean("context_tokens"),
        "probed_tokens_mean": (sum(r["probed_tokens"] for r in rows) / len(rows)
                               if rows and all("probed_tokens" in r for r in rows) else math.nan),
        "seconds_mean": (sum(r["seconds"] for r in rows) / len(rows)      # the op's own wall time, timed
                         if rows and all("seconds" in r for r in rows) else math.nan),
    }
