"""Lower layers never import the layers that use them, and no module imports itself round a circle.

plan, config, runtime, data, engine and resilience are the library, with ``ds_recycle.events`` (the event schema)
at the ground; the public face (``ds_recycle.api``), process supervision (launcher, cli) and the clients of the
public API (the built-in GPT, its training loop, the tools, the cluster simulator) sit above them.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "ds_recycle"
LOWER = ("plan", "config", "runtime", "data", "engine", "resilience")
UPPER = ("api", "launcher", "cli", "train", "model", "tools", "cluster")


def _imports(path: Path) -> list[str]:
    """Every module ``path`` imports, wherever the import stands (top level, inside a function, under
    ``TYPE_CHECKING``): a lazy import is still a dependency."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__")


def _graph() -> dict[str, set[str]]:
    """Module -> the ds_recycle modules it imports (a name resolves to the longest module it names)."""
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}

    def target(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = {target(n) for n in _imports(path) if n == "ds_recycle" or n.startswith("ds_recycle.")}
        graph[name] = {d for d in deps if d is not None and d != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("layer", LOWER)
def test_lower_layer_imports_nothing_above_it(layer: str) -> None:
    bad = [f"{path.relative_to(PKG.parent)} imports {name}" for path in sorted((PKG / layer).rglob("*.py"))
           for name in _imports(path) if any(name == f"ds_recycle.{u}" or name.startswith(f"ds_recycle.{u}.")
                                             for u in UPPER)]
    assert not bad, "\n".join(bad)


def test_the_planner_imports_no_torch() -> None:
    bad = [f"{path.name} imports {name}" for path in sorted((PKG / "plan").rglob("*.py")) for name in _imports(path)
           if name.split(".")[0] in ("torch", "deepspeed")]
    assert not bad, "\n".join(bad)


def test_the_event_schema_stands_on_nothing() -> None:
    """Workers, launchers and every reader import ``ds_recycle.events``; it imports neither torch nor ds_recycle."""
    names = _imports(PKG / "events.py")
    assert not [n for n in names if n.split(".")[0] in ("torch", "deepspeed", "ds_recycle")], names


def test_no_import_circles() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import circles (lazy and TYPE_CHECKING imports count):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_the_circle_check_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
