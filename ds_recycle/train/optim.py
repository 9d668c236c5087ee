"""The torch optimizer named by the config's DeepSpeed-style ``"optimizer"`` block.

ds_recycle always builds torch's own optimizers: DeepSpeed's fused ones are compiled on first use
(tens of seconds on a CPU machine) and keep state ds_recycle would have to move on failures.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from ds_recycle.config import TrainConfig

__all__ = ["build_optimizer"]


def build_optimizer(cfg: TrainConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """``Adam``, ``AdamW`` or ``SGD`` with the config's params (foreach off: identical math on every rank)."""
    kwargs = dict(cfg.optimizer_params)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    cls = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD}[cfg.optimizer_type]
    try:
        return cls(params, **kwargs)
    except TypeError as e:
        raise ValueError(f"config key 'optimizer.params': {e}. Fix: use the keyword arguments of "
                         f"torch.optim.{cfg.optimizer_type}") from None
