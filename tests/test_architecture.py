"""The shape of the package (docs/architecture.md), read from the source: no import cycles, config/ at the bottom,
module sizes. Imports are read with ``ast`` from every module, including imports inside functions (a lazy
import is still a dependency), so nothing is imported to check them."""

from __future__ import annotations

import ast
import statistics
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "llmtrain"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PKG.rglob("*.py")}


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The llmtrain modules ``name`` imports (a package import counts as its ``__init__``)."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    tree = ast.parse(path.read_text())
    typing_only = {  # `if TYPE_CHECKING:` blocks are annotations, not imports at run time
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
        for stmt in block.body
        for n in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: _imports(p, m, known) for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _without_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's ``__init__`` that only re-exports its submodules is not a dependency of those submodules:
    drop edges from a module to the package that contains it."""
    return {m: {t for t in deps if not m.startswith(t + ".")} for m, deps in graph.items()}


def test_no_import_cycles():
    cycles = _cycles(_without_package_inits(_graph()))
    assert cycles == [], "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_config_imports_only_errors():
    graph = _graph()
    bad = {
        m: sorted(t for t in deps if not (t.startswith("llmtrain.config") or t == "llmtrain.errors"))
        for m, deps in graph.items()
        if m.startswith("llmtrain.config")
    }
    assert {m: d for m, d in bad.items() if d} == {}


def test_the_checker_sees_a_cycle_and_a_lazy_import():
    """The checker itself: a lazy import inside a function is an edge, and a two-module loop is a cycle."""
    graph = _graph()
    assert "llmtrain.models" in graph["llmtrain.train.build"]  # a module-level import
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    lazy = [m for m, p in _modules().items() if "    from llmtrain." in p.read_text()]
    assert lazy and all(graph[m] for m in lazy)


def test_module_sizes():
    sizes = {m: len(p.read_text().splitlines()) for m, p in _modules().items()}
    too_big = {m: n for m, n in sizes.items() if n > 500}
    assert too_big == {}
    assert statistics.median(sizes.values()) < 200
