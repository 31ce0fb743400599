"""The shape of the code: no function in any package (``cluster/``, ``prefill_workers/``,
``decode_workers/``, ``kvruntime/``, ``kvtransport/``, ``bench/``) is over 80 lines
(``end_lineno - lineno + 1`` of each def, nested ones counted on their own too), no module there
is over 400 lines (split by stage), and no ``ContextVar`` is defined in the request-path boxes:
per-request state travels as an explicit ``RequestContext``; the one ContextVar left, the
request id on log lines, lives in ``kvruntime/request_log.py``. Each failure lists every offender."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
BOXES = ("cluster", "prefill_workers", "decode_workers")
PACKAGES = BOXES + ("kvruntime", "kvtransport", "bench")
MAX_LINES = 80
MAX_MODULE_LINES = 400


def _files(boxes: tuple[str, ...] = BOXES) -> list[pathlib.Path]:
    return sorted(f for box in boxes for f in (ROOT / box).rglob("*.py"))


def _rel(f: pathlib.Path) -> str:
    return str(f.relative_to(ROOT)) if f.is_relative_to(ROOT) else f.name


def long_functions(files: list[pathlib.Path], limit: int = MAX_LINES) -> list[str]:
    """``path:line name (N lines)`` for each function or method over ``limit`` lines."""
    out = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{_rel(f)}:{node.lineno} {node.name} ({n} lines)")
    return out


def _is_contextvar_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    fn = node.func
    return (isinstance(fn, ast.Name) and fn.id == "ContextVar") or (
        isinstance(fn, ast.Attribute) and fn.attr == "ContextVar")


def contextvars_defined(files: list[pathlib.Path]) -> list[str]:
    """``path:line`` for each ``ContextVar(...)`` construction."""
    out = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if _is_contextvar_call(node):
                out.append(f"{_rel(f)}:{node.lineno} ContextVar")
    return out


def long_modules(files: list[pathlib.Path], limit: int = MAX_MODULE_LINES) -> list[str]:
    """``path (N lines)`` for each module over ``limit`` lines."""
    out = []
    for f in files:
        n = len(f.read_text(encoding="utf-8").splitlines())
        if n > limit:
            out.append(f"{_rel(f)} ({n} lines)")
    return out


def test_no_function_over_80_lines():
    offenders = long_functions(_files(PACKAGES))
    assert not offenders, f"functions over {MAX_LINES} lines:\n  " + "\n  ".join(offenders)


def test_no_module_over_400_lines():
    offenders = long_modules(_files(PACKAGES))
    assert not offenders, f"modules over {MAX_MODULE_LINES} lines (split by stage):\n  " + "\n  ".join(offenders)


def test_no_contextvar_in_request_path_boxes():
    offenders = contextvars_defined(_files())
    assert not offenders, ("ContextVars defined in the request-path boxes (pass a RequestContext; "
                           "only kvruntime/request_log.REQUEST_ID is allowed):\n  " + "\n  ".join(offenders))


def test_checks_catch_offenders(tmp_path):
    """The checks themselves find a long nested function and a ContextVar (so a green run means
    something)."""
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_LINES))
    src = ("import contextvars\nV = contextvars.ContextVar('v')\n"
           "def outer():\n    def inner():\n" + body + "\n    return inner\n")
    f = tmp_path / "m.py"
    f.write_text(src)
    assert [o.split(" ")[1] for o in long_functions([f])] == ["outer", "inner"]
    assert len(contextvars_defined([f])) == 1
    short = tmp_path / "s.py"
    short.write_text("def f():\n    return 1\n")
    assert long_functions([short]) == [] and contextvars_defined([short]) == []
    big = tmp_path / "big.py"
    big.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert long_modules([big]) == [f"big.py ({MAX_MODULE_LINES + 1} lines)"] and long_modules([short]) == []
