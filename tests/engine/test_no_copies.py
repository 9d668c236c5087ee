"""The failure-free step copies no model state: no optimizer ``state_dict``, no clone of a parameter.

The stage stepper runs alone (one replica, so no all-reduce); its norm exchange is a local stand-in for the
broadcast from the first stage. Clipping is on and the stage is not the first, the case that used to step
eagerly and keep a copy of its parameters and optimizer state for post-validation.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_recycle.engine.optimizer import StaggeredOptimizer


class _LocalNorm(StaggeredOptimizer):
    """The first stage's norm is ``norm_sq``; the exchange completes at once."""

    norm_sq = 4.0

    def _broadcast_norm(self, tensor: torch.Tensor, src: int) -> Any:
        tensor.fill_(self.norm_sq)
        return None

    def _wait(self, work: Any) -> None:
        return None


def _stepper(max_norm: float) -> tuple[torch.nn.Module, _LocalNorm]:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.01)
    return module, _LocalNorm(module, optimizer, stage=1, pipelines=1, transport=None, dp_ranks=[0],
                              max_norm=max_norm, norm_source=0, rank=0, served=frozenset({0}))


def _iteration(module: torch.nn.Module, stepper: StaggeredOptimizer, k: int) -> None:
    stepper.finish()
    module(torch.randn(4, 8)).square().sum().backward()
    stepper.reduce(None)
    stepper.step(k, synchronous=False)


@pytest.mark.parametrize("max_norm", [0.0, 1.0, 100.0])  # off, clipped (norm 2 > 1), not clipped
def test_failure_free_steps_copy_no_parameters_and_no_optimizer_state(monkeypatch: pytest.MonkeyPatch,
                                                                      max_norm: float) -> None:
    module, stepper = _stepper(max_norm)
    shapes = {tuple(p.shape) for p in module.parameters()}
    _iteration(module, stepper, 0)  # warm-up: the optimizer creates its state
    copies: list[str] = []
    clone = torch.Tensor.clone

    def counting_clone(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if tuple(self.shape) in shapes:
            copies.append(f"clone of a {tuple(self.shape)} tensor")
        return clone(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "clone", counting_clone)
    monkeypatch.setattr(torch.optim.AdamW, "state_dict", lambda self: copies.append("optimizer state_dict"))
    for k in range(1, 4):
        _iteration(module, stepper, k)
    stepper.finish()
    assert copies == []
    assert stepper.clipped_steps == (4 if max_norm == 1.0 else 0)  # the warm-up step too


def test_a_reduction_without_its_step_can_be_undone() -> None:
    """A failure between the reduction and the step: the rows come back as they were (the reduced sums were new
    tensors), so the stage can reduce again."""
    module, stepper = _stepper(1.0)
    module(torch.randn(4, 8)).square().sum().backward()
    before = [p.grad.clone() for p in module.parameters()]
    rows = [p.grad for p in module.parameters()]
    stepper.reduce(None)
    assert all(p.grad is not r for p, r in zip(module.parameters(), rows))
    stepper.revert()
    assert all(torch.equal(p.grad, b) for p, b in zip(module.parameters(), before))
