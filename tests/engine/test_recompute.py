"""Activation checkpointing under the B/W split: the non-reentrant recompute gives the plain backward's gradients.

One process, no process group: a stage of dropout MLP segments run through
:func:`~ds_recycle.engine.recompute.recompute_checkpoint` inside the micro-batch's RNG context; B asks for the
input gradient only, W (one whole-stage pass, as the engine runs a checkpointed stage) for the weight gradients.
"""
from __future__ import annotations

import torch
from torch import nn

from ds_recycle.engine.backward import OwnerCapture, backward_input
from ds_recycle.engine.recompute import recompute_checkpoint
from ds_recycle.engine.rng import micro_batch_rng


class _Segmented(nn.Module):
    """Three (Linear, ReLU, Dropout) segments, each optionally checkpointed; counts the segments' forwards."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.segments = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Dropout(0.3)) for _ in range(3))
        self.checkpointed = checkpointed
        self.forwards = 0

    def _run(self, index: int, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        return self.segments[index](x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(len(self.segments)):
            x = recompute_checkpoint(lambda t, i=i: self._run(i, t), x) if self.checkpointed else self._run(i, x)
        return x


def _stage(checkpointed: bool) -> _Segmented:
    torch.manual_seed(0)
    return _Segmented(checkpointed)


def test_split_backward_with_recompute_equals_plain_backward_and_replays_dropout() -> None:
    x, g = torch.randn(4, 8), torch.randn(4, 8)
    plain = _stage(checkpointed=False)
    xi = x.clone().requires_grad_(True)
    with micro_batch_rng(7, step=3, pipeline=1, index=2, stage=1):
        plain(xi).backward(g)
    want_dx, want = xi.grad, [p.grad for p in plain.parameters()]

    stage = _stage(checkpointed=True)
    capture = OwnerCapture(stage)
    capture.per_owner = False
    xi = x.clone().requires_grad_(True)
    with capture.capture() as cap, micro_batch_rng(7, step=3, pipeline=1, index=2, stage=1):
        out = stage(xi)
    torch.rand(100)  # the global generator moves on between the forward and the backward
    assert stage.forwards == 3
    dx, work = backward_input(out, g, xi, cap, capture)
    assert all(p.grad is None for p in stage.parameters()), "B must not compute weight gradients"
    assert stage.forwards == 6, "B recomputes every segment once"
    work.run()
    assert stage.forwards == 9, "W recomputes every segment once (one whole-stage pass)"
    assert torch.equal(dx, want_dx)
    for got, ref in zip((p.grad for p in stage.parameters()), want):
        assert got is not None and torch.equal(got, ref)  # the same dropout masks on every recompute
