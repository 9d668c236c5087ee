"""Lower layers never import the layers that use them (see README, "Layout").

plan, config, runtime, data, engine and resilience are the library; the public face (``ds_recycle.api``),
process supervision (launcher, cli) and the clients of the public API (the built-in GPT, its training loop,
the tools, the cluster simulator) sit above them.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "ds_recycle"
LOWER = ("plan", "config", "runtime", "data", "engine", "resilience")
UPPER = ("api", "launcher", "cli", "train", "model", "tools", "cluster")


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


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
