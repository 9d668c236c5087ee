"""The emulated accelerator's layer: F, B and W sleep where they should, and its gradients are exact.

Timing assertions use sleeps of 0.2-0.4 s against margins of 0.15 s, so a busy machine makes them slower,
never wrong in the direction that would hide a missing or misplaced sleep (a missing 0.4 s sleep cannot pass
a ">= 0.38 s" check; a sleep in the wrong half adds 0.3 s or more above an upper bound that allows 0.15 s).
"""
from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from benchmarks.emulated.layers import EmulatedLayer, OpCost
from benchmarks.emulated.profiles import profile

F, B, W = 0.2, 0.3, 0.4
SLACK = 0.15

pytestmark = pytest.mark.timeout(60)


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _layer_and_input() -> tuple[EmulatedLayer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layer = EmulatedLayer(F, B, W, width=5)
    with torch.no_grad():
        layer.weight.normal_()
    x = torch.randn(3, 5, requires_grad=True)
    return layer, x, torch.randn(3, 5)


@pytest.fixture(scope="module", autouse=True)
def _warm_autograd() -> None:
    """The first backward of a process starts autograd's machinery; keep that out of the timed calls."""
    layer = EmulatedLayer(width=2)
    x = torch.randn(1, 2, requires_grad=True)
    out = layer(x)
    torch.autograd.grad(out, [x], torch.ones_like(out), retain_graph=True)
    torch.autograd.backward(out, torch.ones_like(out), inputs=[layer.weight])
    layer(x).sum().backward()


def test_forward_sleeps_f() -> None:
    layer, x, _ = _layer_and_input()
    assert F - 0.02 <= _timed(lambda: layer(x)) <= F + SLACK


def test_input_gradient_alone_sleeps_b_only() -> None:
    layer, x, g = _layer_and_input()
    out = layer(x)
    took = _timed(lambda: torch.autograd.grad(out, [x], g, retain_graph=True))
    assert B - 0.02 <= took <= B + SLACK
    assert layer.weight.grad is None


def test_weight_gradient_alone_sleeps_w_only() -> None:
    layer, x, g = _layer_and_input()
    out = layer(x)
    took = _timed(lambda: torch.autograd.backward(out, g, inputs=[layer.weight]))
    assert W - 0.02 <= took <= W + SLACK
    assert x.grad is None and layer.weight.grad is not None


def test_fused_backward_sleeps_b_and_w() -> None:
    layer, x, g = _layer_and_input()
    out = layer(x)
    took = _timed(lambda: out.backward(g))
    assert B + W - 0.02 <= took <= B + W + SLACK


def test_gradients_are_those_of_x_plus_weight() -> None:
    layer, x, g = _layer_and_input()
    fast = EmulatedLayer(cost=OpCost(0.0, 0.0, 0.0), width=5)
    with torch.no_grad():
        fast.weight.copy_(layer.weight)
    out = fast(x)
    gx, gw = torch.autograd.grad(out, [x, fast.weight], g)
    ref_x = x.detach().clone().requires_grad_(True)
    ref_w = fast.weight.detach().clone().requires_grad_(True)
    ref = ref_x + ref_w
    rx, rw = torch.autograd.grad(ref, [ref_x, ref_w], g)
    assert torch.equal(out, ref)
    assert torch.equal(gx, rx) and torch.equal(gw, rw)
    assert torch.allclose(gw, g.sum(0))


def test_split_backward_equals_fused() -> None:
    torch.manual_seed(1)
    a = EmulatedLayer(0, 0, 0, width=4)
    b = EmulatedLayer(0, 0, 0, width=4)
    x = torch.randn(2, 4, requires_grad=True)
    g = torch.randn(2, 4)
    out = b(a(x) * 3.0)
    gx, = torch.autograd.grad(out, [x], g, retain_graph=True)
    torch.autograd.backward(out, g, inputs=[a.weight, b.weight])
    split = (gx, a.weight.grad.clone(), b.weight.grad.clone())
    a.weight.grad = b.weight.grad = None
    x2 = x.detach().clone().requires_grad_(True)
    b(a(x2) * 3.0).backward(g)
    assert torch.equal(split[0], x2.grad)
    assert torch.equal(split[1], a.weight.grad) and torch.equal(split[2], b.weight.grad)


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="OpCost.b"):
        OpCost(0.1, -1.0, 0.1)
    with pytest.raises(TypeError, match="embedding"):
        EmulatedLayer(width=4)(torch.zeros(2, 4, dtype=torch.long))


def test_profile_keeps_published_ratios() -> None:
    p = profile("gpt3-2.7b", 4, 4, f_ms=100.0)
    assert max(p["F"]) == pytest.approx(100.0)
    for kind in ("F", "B", "W"):
        assert [round(v / p["scale"], 3) for v in p[kind]] == pytest.approx(p["a100_ms"][kind], abs=2e-3)
    assert all(w < b for w, b in zip(p["W"], p["B"]))
    with pytest.raises(ValueError, match="unknown"):
        profile("gpt2", 4, 4)
