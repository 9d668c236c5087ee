"""Put on ``PYTHONPATH`` by ``tests/byom/harness.py`` only: stock DeepSpeed runs skip the shared-memory op build.

DeepSpeed's CPU backend builds the C++ ``deepspeed_shm_comm`` op in ``deepspeed.init_distributed()``
(``deepspeed/comm/torch.py`` ``build_shm_op``) unless ``deepspeed.ops.__compatible_ops__`` says the op is not
compatible; only inference all-reduces use it. There is no environment setting for that, so this hook waits
until ``deepspeed.comm.torch`` is loaded and wraps its ``build_shm_op`` so that the flag is cleared just before
DeepSpeed looks at it. Nothing of DeepSpeed is imported early, and the user's script is not changed.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

_TARGET = "deepspeed.comm.torch"


def _without_shm(build: Any) -> Any:
    def build_shm_op() -> Any:
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        return build()

    return build_shm_op


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        module.build_shm_op = _without_shm(module.build_shm_op)  # type: ignore[attr-defined]


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


sys.meta_path.insert(0, _Finder())
