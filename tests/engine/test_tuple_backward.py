"""B, W and the fused backward with tuple stage inputs and outputs equal one plain autograd backward.

Tuples as Megatron-style stages pass them: floating-point tensors (fp32 and bf16) that get gradients, and a
bool mask that gets none; owners that return tuples are split per owner (no whole-stage fallback).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_recycle.engine.backward import OwnerCapture, backward_fused, backward_input, grad_buffers

Tensors = tuple[torch.Tensor, ...]


class _Embed(nn.Module):
    """An owner returning a tuple: ``(tokens, mask) -> (hidden, mask)``."""

    def __init__(self, vocab: int, length: int, d: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(vocab, d))
        self.pos = nn.Parameter(torch.randn(length, d))

    def forward(self, inputs: Tensors) -> Tensors:
        tokens, mask = inputs
        return F.embedding(tokens, self.table) + self.pos, mask


class _Mix(nn.Module):
    """No parameters of its own: ``(hidden fp32, mask bool, side bf16) -> (hidden, mask, side)``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin, self.side = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, inputs: Tensors) -> Tensors:
        x, mask, side = inputs
        h = torch.tanh(self.lin(x)) * mask.unsqueeze(-1)
        return h, mask, self.side(h).to(torch.bfloat16) + side


class _Partial(nn.Module):
    """Ignores its second floating-point input and returns a constant float that needs no gradient."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, inputs: Tensors) -> Tensors:
        x, _unused = inputs
        return self.lin(x), torch.zeros(2, 3)


def _leaves(inputs: Tensors) -> Tensors:
    return tuple(t.clone().requires_grad_(t.is_floating_point()) for t in inputs)


def _middle_case() -> tuple[nn.Module, Tensors, Tensors]:
    torch.manual_seed(0)
    stage = nn.Sequential(_Mix(8), _Mix(8))
    inputs = (torch.randn(2, 3, 8), torch.rand(2, 3) > 0.3, torch.randn(2, 3, 8).to(torch.bfloat16))
    grads = (torch.randn(2, 3, 8), torch.randn(2, 3, 8).to(torch.bfloat16))
    return stage, inputs, grads


def _reference(stage: nn.Module, inputs: Tensors, grads: Tensors) -> tuple[list[torch.Tensor | None], list]:
    stage.zero_grad(set_to_none=True)
    leaves = _leaves(inputs)
    out = stage(leaves)
    floats = [t for t in out if t.is_floating_point()]
    torch.autograd.backward(floats, list(grads))
    return [t.grad for t in leaves if t.is_floating_point()], [p.grad.clone() for p in stage.parameters()]


def _assert_grads(got: object, want: list[torch.Tensor | None]) -> None:
    assert isinstance(got, tuple) and len(got) == len(want)
    for g, w in zip(got, want):
        assert w is not None and g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w)


def test_split_with_tuple_input_and_output_matches_autograd() -> None:
    stage, inputs, grads = _middle_case()
    want_dx, want_params = _reference(stage, inputs, grads)
    stage.zero_grad(set_to_none=True)
    capture = OwnerCapture(stage)
    leaves = _leaves(inputs)
    with capture.capture() as cap:
        out = stage(leaves)
    assert isinstance(out, tuple) and out[1].dtype == torch.bool and out[2].dtype == torch.bfloat16
    dx, work = backward_input(out, grads, leaves, cap, capture)
    assert all(p.grad is None for p in stage.parameters()), "B must not touch parameter gradients"
    _assert_grads(dx, want_dx)
    assert work.kinds()[1] == 0 and len(capture.owners) == 4, "every parameter starts at a marked edge"
    work.run()
    for got, ref in zip((p.grad for p in stage.parameters()), want_params):
        torch.testing.assert_close(got, ref)


def test_fused_with_tuple_input_and_output_matches_autograd() -> None:
    stage, inputs, grads = _middle_case()
    want_dx, want_params = _reference(stage, inputs, grads)
    stage.zero_grad(set_to_none=True)
    capture = OwnerCapture(stage)
    leaves = _leaves(inputs)
    dx = backward_fused(stage(leaves), grads, leaves, capture)
    _assert_grads(dx, want_dx)
    assert all(t.grad is None for t in leaves), "the input gradients are handed over, not left on the inputs"
    for got, ref in zip((p.grad for p in stage.parameters()), want_params):
        torch.testing.assert_close(got, ref)


def test_first_stage_owner_returning_a_tuple_is_split_per_owner() -> None:
    torch.manual_seed(1)
    stage = nn.Sequential(_Embed(16, 5, 8), nn.Sequential())
    tokens, mask = torch.randint(0, 16, (2, 5)), torch.rand(2, 5) > 0.5
    grad = torch.randn(2, 5, 8)
    ref_hidden, _ = stage((tokens, mask))
    ref_hidden.backward(grad)
    want = [p.grad.clone() for p in stage.parameters()]
    stage.zero_grad(set_to_none=True)
    capture = OwnerCapture(stage)
    with capture.capture() as cap:
        out = stage((tokens, mask))
    dx, work = backward_input(out, (grad,), None, cap, capture)
    assert dx is None and work.kinds()[1] == 0
    work.run()
    for got, ref in zip((p.grad for p in stage.parameters()), want):
        torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("fused", [False, True])
def test_unused_input_gets_zeros_and_constant_output_is_skipped(fused: bool) -> None:
    torch.manual_seed(2)
    stage = _Partial(4)
    capture = OwnerCapture(stage)
    leaves = _leaves((torch.randn(2, 3, 4), torch.randn(2, 3)))
    with capture.capture() as cap:
        out = stage(leaves)
    assert not out[1].requires_grad
    grads = (torch.randn(2, 3, 4), torch.randn(2, 3))  # one per floating-point output, as the next stage sends
    if fused:
        dx = backward_fused(out, grads, leaves, capture)
    else:
        dx, work = backward_input(out, grads, leaves, cap, capture)
        work.run()
    assert isinstance(dx, tuple) and len(dx) == 2
    torch.testing.assert_close(dx[0], grads[0] @ stage.lin.weight)
    assert torch.equal(dx[1], torch.zeros(2, 3))
    torch.testing.assert_close(stage.lin.weight.grad, torch.einsum("bti,btj->ij", grads[0], leaves[0].detach()))


def test_tuple_output_needs_one_gradient_per_floating_tensor() -> None:
    stage, inputs, grads = _middle_case()
    capture = OwnerCapture(stage)
    leaves = _leaves(inputs)
    with capture.capture() as cap:
        out = stage(leaves)
    with pytest.raises(ValueError, match="2 floating-point tensors needs as many gradients, got 1"):
        backward_input(out, grads[:1], leaves, cap, capture)


def test_grad_buffers_follow_the_floating_point_outputs() -> None:
    out = (torch.zeros(2, 3), torch.zeros(2, dtype=torch.bool), torch.zeros(4, dtype=torch.bfloat16),
           torch.zeros(1, dtype=torch.int64))
    buffers = grad_buffers(out)
    assert isinstance(buffers, tuple)
    assert [(b.shape, b.dtype) for b in buffers] == [((2, 3), torch.float32), ((4,), torch.bfloat16)]
    single = grad_buffers(torch.zeros(3, dtype=torch.bfloat16))
    assert isinstance(single, torch.Tensor) and single.dtype == torch.bfloat16
