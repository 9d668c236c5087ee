"""Put on ``PYTHONPATH`` by the tests' job harnesses only: stock DeepSpeed runs skip the shared-memory op build,
and stock launchers' workers skip the interpreter's module teardown.

DeepSpeed's CPU backend builds the C++ ``deepspeed_shm_comm`` op in ``deepspeed.init_distributed()``
(``deepspeed/comm/torch.py`` ``build_shm_op``) unless ``deepspeed.ops.__compatible_ops__`` says the op is not
compatible; only inference all-reduces use it. There is no environment setting for that, so this hook waits
until ``deepspeed.comm.torch`` is loaded and wraps its ``build_shm_op`` so that the flag is cleared just before
DeepSpeed looks at it. Nothing of DeepSpeed is imported early, and the user's script is not changed.

A worker of a stock launcher (``RANK`` set, not one of ``ds-recycle launch``'s, which leave this way already:
:mod:`ds_recycle.launcher.leave`) also leaves without the interpreter's module teardown. Its last ``atexit``
callback, which runs after the other threads were joined and every other callback ran, flushes the files still
open for writing and ends the process with the status the interpreter would have given (an uncaught exception 1,
``sys.exit(code)`` its code). What the script computed, printed and saved is the same; the 2-4 s of CPU that
torch's and gloo's destructors take in each of a job's workers are not spent.
"""
from __future__ import annotations

import atexit
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

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


def _leave_without_teardown() -> None:
    # ds_recycle's own exit steps, loaded from their file: importing the package would import torch here
    path = Path(__file__).resolve().parents[2] / "ds_recycle" / "launcher" / "leave.py"
    spec = importlib.util.spec_from_file_location("_ds_recycle_leave", path)
    assert spec is not None and spec.loader is not None
    steps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(steps)
    status = [0]
    excepthook, exit = sys.excepthook, sys.exit

    def uncaught(*exc: Any) -> None:
        status[0] = 1
        excepthook(*exc)

    def recorded_exit(code: str | int | None = None) -> NoReturn:
        status[0] = steps.exit_status(code) if isinstance(code, int) or code is None else 1
        exit(code)

    sys.excepthook, sys.exit = uncaught, recorded_exit
    atexit.register(lambda: steps.flush_and_exit(status[0]))


if "RANK" in os.environ and "DS_RECYCLE_LAUNCHER" not in os.environ:
    _leave_without_teardown()
