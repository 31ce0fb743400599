"""The per-length tables of ``python -m bench.engine``: whole operations against the model's own
forward, then the pieces against their byte/FLOP floors (rows from ``bench.engine.length_row``)."""
from __future__ import annotations


def print_tables(rows: list[dict]) -> None:
    """The per-length tables: whole operations with their ratios, then the pieces with their floors."""
    cols = [c for c in ("recompute", "hf", "compose", "erratum+q", "edit K=16") if c in rows[0]]
    print()
    print("| tokens | " + " | ".join(cols) + " | recompute/hf | hf/compose | hf/(erratum+q) |")
    print("|---" * (len(cols) + 4) + "|")
    for r in rows:
        rat = [f"{r['recompute'] / r['hf']:.2f}" if "hf" in r and "recompute" in r else "-",
               f"{r['hf'] / r['compose']:.1f}x" if "hf" in r else "-",
               f"{r['hf'] / r['erratum+q']:.1f}x" if "hf" in r else "-"]
        print(f"| {r['tokens']} | " + " | ".join(f"{r[c]:.3f} s" for c in cols) + " | " + " | ".join(rat) + " |")
    print()
    print("| tokens | tier read (GB/s) | rotate (GB/s) | rotate / copy | seam (floor) | question (floor) "
          "| recompute floor |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        gb = 2 * r["kv_bytes"] / 1e9
        fr = r["floor"]
        print(f"| {r['tokens']} | {r['tier read'] * 1e3:.1f} ms ({gb / r['tier read']:.1f}) | "
              f"{r['rotate'] * 1e3:.1f} ms ({gb / r['rotate']:.1f}) | {r['tier read'] / r['rotate']:.0%} | "
              f"{r['seam'] * 1e3:.1f} ms ({fr['seam'] * 1e3:.1f}) | {r['question'] * 1e3:.1f} ms "
              f"({fr['question'] * 1e3:.1f}) | {fr['recompute']:.3f} s |")
