"""The training loop behind ``launch/train.py``: one loop, two engines (DeepSpeed's and ds_recycle's)."""
from ds_recycle.train.runner import IterationResult, Runner

__all__ = ["IterationResult", "Runner"]
