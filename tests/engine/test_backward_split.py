"""B/W split equals the fused backward, bit for bit or to float rounding, on transformer-like stages."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_recycle.engine.backward import OwnerCapture, backward_input


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        x = x + self.proj(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class _Shared(nn.Module):
    """One Linear applied twice: the per-module split would double count, so W must fall back."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


def _reference(stage: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    stage.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    stage(xi).backward(g)
    return xi.grad, [p.grad.clone() for p in stage.parameters()]


@pytest.mark.parametrize("make", [lambda: nn.Sequential(_Block(16), _Block(16)), lambda: _Shared(16)])
def test_split_matches_fused(make) -> None:
    torch.manual_seed(0)
    stage = make()
    x, g = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    want_dx, want = _reference(stage, x, g)
    stage.zero_grad(set_to_none=True)
    capture = OwnerCapture(stage)
    xi = x.clone().requires_grad_(True)
    with capture.capture() as cap:
        out = stage(xi)
    dx, work = backward_input(out, g, xi, cap, capture)
    assert all(p.grad is None for p in stage.parameters()), "B must not touch parameter gradients"
    torch.testing.assert_close(dx, want_dx, rtol=1e-6, atol=1e-7)
    work.run()
    for got, ref in zip((p.grad for p in stage.parameters()), want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)


def test_first_stage_without_input_grad_and_loss_root() -> None:
    torch.manual_seed(1)
    stage = nn.Sequential(nn.Embedding(32, 16), _Block(16), nn.Linear(16, 32))
    tokens = torch.randint(0, 32, (2, 8))
    loss_fn = nn.CrossEntropyLoss()
    ref = loss_fn(stage(tokens).view(-1, 32), tokens.view(-1)) / 4
    ref.backward()
    want = [p.grad.clone() for p in stage.parameters()]
    stage.zero_grad(set_to_none=True)
    capture = OwnerCapture(stage)
    with capture.capture() as cap:
        loss = loss_fn(stage(tokens).view(-1, 32), tokens.view(-1)) / 4
    dx, work = backward_input(loss, None, None, cap, capture)
    assert dx is None and work.kinds()[1] == 0, "every parameter starts at a marked edge"
    work.run()
    for got, ref_g in zip((p.grad for p in stage.parameters()), want):
        torch.testing.assert_close(got, ref_g, rtol=1e-5, atol=1e-7)
