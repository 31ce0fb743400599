"""The boxes of the flow form a ladder: no import cycle between top-level packages, and the
message module at the bottom imports no model runtime (torch, transformers, Ray)."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()} - {"tests"}


def _edges() -> dict[str, set[str]]:
    edges = {p: set() for p in PACKAGES}
    for p in PACKAGES:
        for f in (ROOT / p).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
                edges[p] |= {n.split(".")[0] for n in names if n.split(".")[0] in PACKAGES} - {p}
    return edges


def test_no_cycle_between_top_level_packages():
    edges = _edges()

    def reach(a):
        seen, stack = set(), [a]
        while stack:
            for b in edges[stack.pop()]:
                if b not in seen:
                    seen.add(b)
                    stack.append(b)
        return seen
    cycles = sorted({tuple(sorted((a, b))) for a in PACKAGES for b in reach(a) if a in reach(b)})
    assert cycles == [], f"packages importing each other: {cycles} (edges: {edges})"
    for p in ("prefill_workers", "decode_workers", "kvtransport", "kvruntime"):
        assert "cluster" not in edges[p], f"{p} imports the control plane"


def test_the_message_module_is_torch_free():
    code = ("import sys; import kvruntime.messages.plan, kvruntime.messages.keys, kvruntime.messages.decode, "
            "kvruntime.messages.prefill, kvruntime.messages.config, cluster.state, cluster.planner; "
            "bad = [m for m in ('torch', 'transformers', 'ray', 'numpy') if m in sys.modules]; "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
