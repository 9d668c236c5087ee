"""Run a function on a module once it is imported: now if it already is, else right after its own import.

Pure Python (no torch, no DeepSpeed), for ``import ds_recycle`` and the worker bootstrap, which both act on
DeepSpeed as soon as a script imports it.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

__all__ = ["after_import"]


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds ``name`` as the other finders do (then steps aside) and runs ``callback`` once its module executed."""

    def __init__(self, name: str, callback: Callable[[ModuleType], None], tag: str) -> None:
        self.name, self.callback, self.tag = name, callback, tag

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None,
                  ) -> importlib.machinery.ModuleSpec | None:
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run, callback = spec.loader.exec_module, self.callback

        def exec_module(module: ModuleType) -> None:
            run(module)
            callback(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def after_import(name: str, callback: Callable[[ModuleType], None], tag: str) -> None:
    """``callback(module)`` once ``name`` is imported; a hook of the same ``tag`` is installed only once."""
    if name in sys.modules:
        callback(sys.modules[name])
    elif not any(isinstance(f, _AfterImport) and f.tag == tag for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, callback, tag))
