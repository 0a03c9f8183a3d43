"""The import layers of the package: no module imports a layer above it, and no two units import
each other (directly or round a cycle). A unit is a subpackage (zeroband/comm/) or a top-level module
(zeroband/mesh.py). Imports inside functions count too: they are how cycles hide."""

from __future__ import annotations

import ast
from pathlib import Path

import zeroband

ROOT = Path(zeroband.__file__).parent
# Lowest first. Each unit may import only units of its own or a lower row.
LAYERS = [
    ["config", "watchdog", "seams", "records"],
    ["trust", "data", "models", "optim"],
    ["store"],
    ["comm", "wan"],
    ["mesh", "world", "fingerprint", "checkpoint", "resume_rules", "rundir", "metrics"],
    ["membership"],
    ["outer", "checkpointer", "torchrun"],
]


def unit_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "zeroband" and len(parts) > 1 else None


def module_of(path: Path) -> str:
    return ".".join(("zeroband", *path.relative_to(ROOT).with_suffix("").parts))


def imports_of(path: Path, here: str | None = None) -> set[str]:
    """Every zeroband unit the file imports, at any depth; `here` is its module name."""
    here = here or module_of(path)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here.split(".")[: -node.level] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names] if base == "zeroband" else [base]
        found |= {u for u in map(unit_of, names) if u}
    return found


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        unit = unit_of(module_of(path))
        if unit and unit != "__init__":
            edges.setdefault(unit, set()).update(imports_of(path) - {unit})
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_unit_imports_a_layer_above_it() -> None:
    row = {unit: i for i, units in enumerate(LAYERS) for unit in units}
    upward = sorted(f"{u} imports {v}" for u, vs in graph().items() if u in row
                    for v in vs if row.get(v, len(LAYERS)) > row[u])
    assert upward == []


def test_no_package_cycle() -> None:
    assert cycles(graph()) == []


def test_the_checker_sees_function_level_and_relative_imports(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from zeroband.outer import diloco\n    import zeroband.comm.group\n"
                   "from ..store import client\nfrom . import mac\n")
    assert imports_of(src, here="zeroband.trust.m") == {"outer", "comm", "store", "trust"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
