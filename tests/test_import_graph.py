"""The boxes of the flow form a ladder: no import cycle between top-level packages, none between
modules (any import counts: top-level, inside a function, or under ``TYPE_CHECKING``), the
control plane's three boxes import one way (http -> control; operator above both), and the message
module at the bottom imports no model runtime (torch, transformers, Ray)."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()} - {"tests"}


def _module_name(f: pathlib.Path) -> str:
    parts = list(f.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(f): f for p in PACKAGES for f in (ROOT / p).rglob("*.py")}


def _imported(node: ast.AST, here: str, is_pkg: bool, mods: dict) -> set[str]:
    """The repository modules one import statement names (``from a import b`` names ``a.b`` when
    ``b`` is a module, else ``a``); relative imports are resolved against ``here``."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            pkg = here.split(".") if is_pkg else here.split(".")[:-1]
            pkg = pkg[:len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    else:
        return set()
    out = set()
    for n in names:
        while n and n not in mods:          # `import a.b.c` of a package: the deepest module named
            n = n.rpartition(".")[0]
        if n:
            out.add(n)
    return out


def module_edges() -> dict[str, set[str]]:
    mods = _modules()
    edges = {}
    for name, f in mods.items():
        tree = ast.parse(f.read_text(encoding="utf-8"))
        edges[name] = set().union(*(_imported(n, name, f.name == "__init__.py", mods) for n in ast.walk(tree))) - {name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1
        stack.append(root); on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in edges:
                    continue
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1
                    stack.append(w); on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop(); on.discard(w); comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def _package_edges() -> dict[str, set[str]]:
    edges = {p: set() for p in PACKAGES}
    for a, bs in module_edges().items():
        edges[a.split(".")[0]] |= {b.split(".")[0] for b in bs} - {a.split(".")[0]}
    return edges


def test_no_cycle_between_top_level_packages():
    edges = _package_edges()
    assert cycles(edges) == [], f"packages importing each other: {cycles(edges)} (edges: {edges})"
    for p in ("prefill_workers", "decode_workers", "kvtransport", "kvruntime"):
        assert "cluster" not in edges[p], f"{p} imports the control plane"


def test_no_cycle_between_modules():
    found = cycles(module_edges())
    assert found == [], f"modules importing each other (directly or round a loop): {found}"


def test_cycle_finder_sees_direct_and_indirect_cycles():
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_import_finder_sees_lazy_and_relative_imports(tmp_path):
    mods = {"pkg": None, "pkg.a": None, "pkg.b": None, "pkg.sub": None, "pkg.sub.c": None}
    src = ("import pkg.sub.c\nfrom pkg import b\nfrom . import a\nfrom .sub import c as cc\n"
           "def f():\n    from pkg.sub.c import thing\n")
    tree = ast.parse(src)
    found = set().union(*(_imported(n, "pkg.a", False, mods) for n in ast.walk(tree)))
    assert found == {"pkg.sub.c", "pkg.b", "pkg.a", "pkg.sub.c"}


def test_the_control_plane_boxes_import_one_way():
    """http -> control; operator may import both; control imports neither; nothing imports operator."""
    def box(m):
        parts = m.split(".")
        return parts[1] if parts[0] == "cluster" and len(parts) >= 2 else None
    bad = []
    for a, bs in module_edges().items():
        for b in bs:
            ba, bb = box(a), box(b)
            if bb is None or ba == bb:
                continue
            if (ba, bb) not in {("http", "control"), ("operator", "http"), ("operator", "control")} and \
                    not (ba is None and bb in {"operator", "http", "control"} and not a.startswith("cluster")):
                bad.append(f"{a} -> {b}")
    assert bad == [], f"imports against the direction http -> control, operator -> both: {bad}"
    boxes = {m.split(".")[1] for m in _modules() if m.startswith("cluster.") and m.count(".") >= 1}
    assert {"http", "control", "operator"} <= boxes


def test_the_kvtransport_boxes_stand_apart():
    """kvtransport is two boxes: ``tier`` (the KV tier) and ``transfer`` (prefill -> decode). They
    never import each other (what both need, the dense KV and the messages, lives in ``kvruntime``
    below them); neither imports the control plane or a worker package; every kvtransport module
    sits in one of them (``kvtransport/__init__`` only describes them and imports nothing)."""
    boxes = ("kvtransport.tier", "kvtransport.transfer")

    def box(m):
        return next((b for b in boxes if m == b or m.startswith(b + ".")), None)
    edges = module_edges()
    loose = [m for m in edges if m.startswith("kvtransport") and m != "kvtransport" and box(m) is None]
    assert loose == [], f"kvtransport modules in neither box (tier, transfer): {loose}"
    assert edges["kvtransport"] == set(), f"kvtransport/__init__ imports {edges['kvtransport']}"
    bad = []
    for a, bs in edges.items():
        if box(a) is None:
            continue
        for b in bs:
            top = b.split(".")[0]
            if (box(b) is not None and box(b) != box(a)) or top in {"cluster", "prefill_workers", "decode_workers",
                                                                  "bench"}:
                bad.append(f"{a} -> {b}")
    assert bad == [], f"kvtransport's boxes importing each other, the control plane or the workers: {bad}"
    assert {box(m) for m in edges} >= set(boxes)


def test_bench_only_code_lives_in_bench():
    """The shipped packages never import ``bench`` (bench-only helpers, e.g. ``bench.vllm_shm``)."""
    bad = [f"{a} -> {b}" for a, bs in module_edges().items() if a.split(".")[0] != "bench"
           for b in bs if b.split(".")[0] == "bench"]
    assert bad == [], f"shipped code importing the benchmarks: {bad}"


def test_the_message_module_is_torch_free():
    code = ("import sys; import kvruntime.messages.plan, kvruntime.messages.keys, kvruntime.messages.decode, "
            "kvruntime.messages.prefill, kvruntime.config, cluster.control.state, cluster.control.planner; "
            "kvruntime.config.ClusterConfig.of(port=8001, prefill={'count': 2}); "
            "bad = [m for m in ('torch', 'transformers', 'ray', 'numpy') if m in sys.modules]; "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_config_sits_at_the_bottom():
    """Every process (router, prefill and decode actors) imports ``kvruntime.config``: what it
    reaches, directly or not, is the config's own sections and the model registry it validates
    ``model`` against; no control plane, worker, transport, engine or op."""
    edges, seen, todo = module_edges(), set(), ["kvruntime.config"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += sorted(edges.get(m, ()))
    registry = {"kvruntime.models", "kvruntime.model_spec", "kvruntime.hf_models", "kvruntime.checkpoint",
                "kvruntime.rope_config"}
    outside = sorted(m for m in seen if not m.startswith("kvruntime.config") and m not in registry)
    assert outside == [], f"kvruntime.config reaches {outside}"


def test_the_router_replica_starts_without_torch():
    """The router runs no model: importing the HTTP ingress and running :func:`assemble` up to the
    worker lookup (tokenizer and fidelity profile of the default model loaded, every module it
    imports imported) leaves torch unimported, and the tokenizer class was decided without
    ``AutoTokenizer`` (no fallback counted). The worker lookup is replaced by a stop: no Ray."""
    code = """
import sys
import cluster.http.serve_app
import cluster.control.ray_backends as rb
import kvruntime.tokenizer as kt
from cluster.control.assembly import assemble
from kvruntime.config import ClusterConfig
from kvruntime.fidelity.profiles import calibration_line

class Stop(Exception):
    pass

def stop(*a, **k):
    raise Stop

loaded, load = [], kt.load_tokenizer
kt.load_tokenizer = lambda path: loaded.append(load(path)) or loaded[-1]
rb.RayBackends.from_names = staticmethod(stop)
cfg = ClusterConfig.of(port=8001)
try:
    assemble(cfg)
except Stop:
    pass
from kvruntime.fidelity.profiles import find_profile
from kvruntime.models import get_model_spec
profile = find_profile(get_model_spec(cfg.workers.model), cfg.policy.profiles_dir)
assert profile.calibrated, profile
calibration_line(profile, cfg.workers.model)
assert len(loaded) == 1 and loaded[0].encode("hello"), loaded
assert not kt.FALLBACKS, dict(kt.FALLBACKS)
bad = [m for m in ("torch", "transformers.generation", "transformers.modeling_utils") if m in sys.modules]
assert not bad, bad
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
