"""ds_recycle: ReCycle (SOSP 2024) for DeepSpeed's pipeline engine.

Pure-Python parts (the planner in :mod:`ds_recycle.plan`, the cluster simulator in
:mod:`ds_recycle.cluster`) import neither torch nor DeepSpeed; the runtime parts do.
"""
__version__ = "0.1.0"
__all__ = ["__version__"]
