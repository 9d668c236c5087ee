"""ds_recycle: ReCycle (SOSP 2024) for DeepSpeed's pipeline engine.

Pure-Python parts (the planner in :mod:`ds_recycle.plan`, the cluster simulator in
:mod:`ds_recycle.cluster`) import neither torch nor DeepSpeed; the runtime parts do. ``initialize`` and
``build_pipeline_module`` (the engine's entry points, mirroring ``deepspeed.initialize``) are imported on
first use, so ``import ds_recycle`` stays light.
"""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "initialize", "build_pipeline_module"]

_LAZY = {"initialize": "ds_recycle.engine.initialize", "build_pipeline_module": "ds_recycle.engine.initialize"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ds_recycle' has no attribute {name!r}")
