"""PNG plots of ``bench.vllm_side_by_side`` results (matplotlib, headless)."""
from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_ttft(r: dict, path: Path) -> None:
    """TTFT p50 (log scale) vs context length, one line per system; p90 as a band edge."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    xs = [row["context"] for row in r["compose"]]
    for system, style in (("full recompute", "s-"), ("vLLM APC", "o-"), ("kvnotes + vLLM", "^-")):
        p50 = [row[system]["p50"] for row in r["compose"]]
        p90 = [row[system]["p90"] for row in r["compose"]]
        ax.plot(xs, p50, style, label=f"{system} (p50)")
        ax.fill_between(xs, p50, p90, alpha=0.15)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("context tokens (2-6 precompiled chunks + question)")
    ax.set_ylabel("TTFT (s), band to p90")
    ax.set_title(f"Compose TTFT, {r['model']} {r['dtype']}, one vLLM engine")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_edit(r: dict, path: Path) -> None:
    """Field-edit sessions: prefix reuse and TTFT p50 per system."""
    plt = _plt()
    e = r["edit"]
    systems = ["vLLM APC", "kvnotes erratum", "kvnotes edit-in-place", "full recompute"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.8), dpi=120)
    a1.bar(range(4), [100 * e[s]["hit"] for s in systems], color=["C0", "C2", "C1", "C7"])
    a1.set_ylabel("prompt tokens reused (%)")
    a1.set_ylim(0, 100)
    a2.bar(range(4), [e[s]["p50"] for s in systems], color=["C0", "C2", "C1", "C7"])
    a2.set_ylabel("TTFT p50 (s)")
    for ax in (a1, a2):
        ax.set_xticks(range(4), [s.replace("kvnotes ", "kvnotes\n") for s in systems], fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"Field-edit sessions: {e['sessions']} sessions, ~{e['context']} tokens, field early")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
