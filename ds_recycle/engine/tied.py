"""Weights tied across stages (``TiedLayerSpec``): one gradient for every copy, whoever computed its parts.

A ``PipelineModule`` built with ``TiedLayerSpec(key, ...)`` in several stages (an input embedding reused as the
output head) keeps one copy of the module on each owner stage. DeepSpeed sums the tied weights' gradients over the
owner stages of a pipeline (``ReduceTiedGrads``), then averages every gradient over the pipelines. With failures
a stage's gradient is the sum over whoever processed its micro-batches, so ds_recycle reduces in the other order:
each stage first reduces its own gradients over its live replicas (``StaggeredOptimizer.reduce``: the stage's sum
over all ``D x M`` micro-batches, divided by ``D``), then the tied weights' reduced gradients are summed over the
owner stages. The first live replica of each owner stage contributes its stage's gradient and every other member
zeros, so the sum has two non-zero terms and is exact in any order: every copy gets the same gradient and steps
to the same value. Only the attributes named by ``tied_weight_attr`` are tied, as in DeepSpeed.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["TiedWeight", "reduce_tied", "tied_members", "tied_weights"]


@dataclass(frozen=True)
class TiedWeight:
    """One tied parameter of this worker's stage."""

    key: str
    """The ``TiedLayerSpec`` key."""
    attr: str
    param: nn.Parameter
    stages: tuple[int, ...]
    """Every stage that holds a copy."""

    @property
    def name(self) -> str:
        """The group name: one group per key (all of a key's attributes share it)."""
        return f"tied-{self.key}"


def tied_weights(module: Any) -> list[TiedWeight]:
    """The tied parameters of ``module`` (a ``PipelineModule``) that other stages also hold, in a fixed order."""
    from deepspeed.runtime.pipe.module import TiedLayerSpec

    owners: dict[str, set[int]] = {}
    for idx, spec in enumerate(module._layer_specs):
        if isinstance(spec, TiedLayerSpec):
            owners.setdefault(spec.key, set()).add(module.stage_owner(idx))
    found = []
    for key in sorted(owners):
        if len(owners[key]) < 2 or key not in module.tied_modules:
            continue
        for attr in module.tied_weight_attrs[key]:
            param = module._recursive_getattr(module.tied_modules[key], attr)
            found.append(TiedWeight(key, attr, param, tuple(sorted(owners[key]))))
    return found


def tied_members(tied: TiedWeight, stage_ranks: Callable[[int], list[int]]) -> list[int]:
    """Global ranks of the live workers that hold a copy of ``tied``."""
    return sorted(r for s in tied.stages for r in stage_ranks(s))


def reduce_tied(tied: list[TiedWeight], contributes: bool, all_reduce: Callable[[str, torch.Tensor], None],
                holder: Callable[[nn.Parameter], nn.Parameter] = lambda p: p) -> None:
    """Sum each tied weight's (stage-reduced) gradient over its owner stages, in place (see the module docstring).

    ``contributes``: this worker is its stage's first live replica. ``all_reduce(group name, tensor)`` sums in place
    over the members of that key's group. ``holder(param)``: the tensor whose ``.grad`` holds the parameter's
    reduced gradient (its fp32 master in bf16, as DeepSpeed reduces the tied weights' high-precision gradients).
    """
    for t in tied:
        param = holder(t.param)
        grad = param.grad
        if grad is None:
            grad = param.grad = torch.zeros_like(param)
        buf = grad.detach().clone() if contributes else torch.zeros_like(grad)
        all_reduce(t.name, buf)
        grad.copy_(buf)
