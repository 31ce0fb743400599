"""PNG plots of ``bench.vllm_side_by_side`` and ``bench.cluster_vs_vllm`` results (matplotlib, headless)."""
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


def plot_cluster_vs_vllm(r: dict, folder: Path) -> list[Path]:
    """``bench.cluster_vs_vllm``: TTFT per workload vs context (both systems), and kvnotes' stage
    breakdown per workload and size (stacked mean seconds)."""
    from bench.cluster_vs_vllm_report import OUTSIDE, STAGE_COLS, size_rows, stage_means
    plt = _plt()
    folder.mkdir(parents=True, exist_ok=True)
    rows = size_rows(r)
    xs = [x["size"] for x in rows]
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(13, 4.0), dpi=110)
    for key, label, style in (("compose", "kvnotes compose (cluster)", "^-"), ("inprocess", "kvnotes compose (in-process)", "^:"),
                              ("recompute", "vLLM recompute", "s-"), ("hit", "vLLM exact prefix hit", "o-")):
        pts = [(x["size"], x[key]) for x in rows if key in x]
        if pts:
            a1.plot(*zip(*pts), style, label=label)
    for key, label, style in (("cold_k", "kvnotes", "^-"), ("cold_v", "vLLM", "s-")):
        pts = [(x["size"], x[key]) for x in rows if key in x]
        if pts:
            a2.plot(*zip(*pts), style, label=label)
    for key, label, style in (("edit_k90", "kvnotes session p90", "^-"), ("edit_v90", "vLLM APC p90", "s-"),
                              ("edit_k50", "kvnotes session p50", "^:"), ("edit_v50", "vLLM APC p50", "s:")):
        pts = [(x["size"], x[key]) for x in rows if key in x]
        if pts:
            a3.plot(*zip(*pts), style, label=label)
    for ax, title in ((a1, "compose (skills + question)"), (a2, "cold prompt"), (a3, "field-edit session turn")):
        ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("context tokens")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    a1.set_ylabel("client TTFT over HTTP (s)")
    fig.suptitle(f"kvnotes cluster vs plain vLLM, {r['model']} {r['dtype']}, one run")
    fig.tight_layout()
    p1 = folder / "cluster_vs_vllm_ttft.png"
    fig.savefig(p1)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 4.2), dpi=110)
    labels = []
    cols = [*STAGE_COLS, OUTSIDE]
    stacks = []
    for x in rows:
        for wl, key in (("compose", "compose_recs"), ("cold", "cold_recs"), ("edit", "edit_recs")):
            if x.get(key):
                labels.append(f"{wl}\n{x['size']}")
                stacks.append(stage_means(x[key]))
    bottoms = [0.0] * len(stacks)
    for j, c in enumerate(cols):
        vals = [m.get(c, 0.0) for m in stacks]
        if c == "first_token":        # the engine's own part (receive/load are their own bars)
            vals = [max(0.0, m.get(c, 0.0) - m.get("receive", 0.0) - m.get("load", 0.0)) for m in stacks]
        if not any(vals):
            continue
        ax.bar(range(len(stacks)), vals, bottom=bottoms, label=c if c != OUTSIDE else "outside KV path",
               color=f"C{j % 10}")
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("mean seconds per request")
    ax.set_title("kvnotes stage breakdown through the cluster (explain.stages; first_token net of receive/load)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    p2 = folder / "cluster_vs_vllm_stages.png"
    fig.savefig(p2)
    plt.close(fig)
    return [p1, p2]
