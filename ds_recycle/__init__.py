"""ds_recycle: ReCycle (SOSP 2024) for DeepSpeed's pipeline engine.

``ds_recycle.initialize`` is ``deepspeed.initialize`` for a ``PipelineModule`` with the ReCycle engine
(:mod:`ds_recycle.api`): a DeepSpeed pipeline script changes in its import and that one call. Pure-Python
parts (the planner in :mod:`ds_recycle.plan`, the cluster simulator in :mod:`ds_recycle.cluster`) import
neither torch nor DeepSpeed; ``initialize`` is imported on first use, so ``import ds_recycle`` stays light.
``import ds_recycle`` keeps DeepSpeed's ``init_distributed`` on a CPU machine from JIT-compiling a
shared-memory op that training never uses (about two minutes the first time), whether DeepSpeed was imported
before it or is imported after (then right after DeepSpeed's own import finishes, through an import hook).
"""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "initialize"]

_LAZY = {"initialize": "ds_recycle.api"}


def _disable_cpu_jit_ops() -> None:
    from ds_recycle.resilience.world import disable_cpu_jit_ops

    disable_cpu_jit_ops()


def _spare_cpu_jit() -> None:
    from ds_recycle._after_import import after_import

    after_import("deepspeed", lambda _: _disable_cpu_jit_ops(), "ds_recycle: no CPU JIT ops")


_spare_cpu_jit()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ds_recycle' has no attribute {name!r}")
