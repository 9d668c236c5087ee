"""The emulated accelerator's layer: F, B and W sleep where they should, and its gradients are exact.

The sleeps are recorded (``time.sleep`` replaced by a recorder), not timed, so a busy machine cannot make these
tests pass or fail: each check names the exact sleeps a forward, an input-gradient-only backward (ds_recycle's
B), a weight-only backward (its W) and a fused backward (vanilla DeepSpeed's) must make. One test sleeps for
real and checks only a lower bound.
"""
from __future__ import annotations

import time

import pytest
import torch

from benchmarks.emulated import layers
from benchmarks.emulated.layers import EmulatedLayer, OpCost
from benchmarks.emulated.profiles import profile

F, B, W = 0.2, 0.3, 0.4

pytestmark = pytest.mark.timeout(60)


class _Clock:
    """``time`` for the layers: ``sleep`` records its argument and moves ``monotonic`` on by it plus ``late``
    (a process that wakes late)."""

    def __init__(self, late: float = 0.0) -> None:
        self.now, self.late, self.made = 1000.0, late, []

    def sleep(self, seconds: float) -> None:
        self.made.append(seconds)
        self.now += seconds + self.late

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    made = _Clock()
    monkeypatch.setattr(layers, "time", made)
    monkeypatch.setattr(layers, "_DEVICE", [float("-inf"), float("-inf")])
    return made


@pytest.fixture
def sleeps(clock: _Clock) -> list[float]:
    """Every ``time.sleep`` the layer makes, in order, instead of sleeping."""
    return clock.made


def _layer_and_input() -> tuple[EmulatedLayer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layer = EmulatedLayer(F, B, W, width=5)
    with torch.no_grad():
        layer.weight.normal_()
    x = torch.randn(3, 5, requires_grad=True)
    return layer, x, torch.randn(3, 5)


def test_forward_sleeps_f(sleeps: list[float]) -> None:
    layer, x, _ = _layer_and_input()
    layer(x)
    assert sleeps == [F]


def test_input_gradient_alone_sleeps_b_only(sleeps: list[float]) -> None:
    layer, x, g = _layer_and_input()
    out = layer(x)
    sleeps.clear()
    torch.autograd.grad(out, [x], g, retain_graph=True)
    assert sleeps == [B]
    assert layer.weight.grad is None


def test_weight_gradient_alone_sleeps_w_only(sleeps: list[float]) -> None:
    layer, x, g = _layer_and_input()
    out = layer(x)
    sleeps.clear()
    torch.autograd.backward(out, g, inputs=[layer.weight])
    assert sleeps == [W]
    assert x.grad is None and layer.weight.grad is not None


def test_fused_backward_sleeps_b_and_w(sleeps: list[float]) -> None:
    layer, x, g = _layer_and_input()
    out = layer(x)
    sleeps.clear()
    out.backward(g)
    assert sorted(sleeps) == [B, W]


def test_b_is_paid_below_an_embedding_on_a_first_stage(sleeps: list[float]) -> None:
    """Token ids need no gradient, but the embedding's output does: B still runs (as on a first stage)."""
    embed, layer = torch.nn.Embedding(7, 5), EmulatedLayer(F, B, W, width=5)
    out = layer(embed(torch.tensor([[1, 2, 3]])))
    h = out.grad_fn.next_functions  # the add's inputs: the input path and the weight path
    assert len(h) == 2
    sleeps.clear()
    torch.autograd.grad(out, [embed.weight], torch.ones_like(out))
    assert sleeps == [B]


def test_sleeps_are_real_sleeps() -> None:
    layer, x, g = _layer_and_input()
    t0 = time.perf_counter()
    layer(x).backward(g)
    assert time.perf_counter() - t0 >= F + B + W - 0.01


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


def test_a_slow_accelerator_sleeps_factor_times_longer(sleeps: list[float]) -> None:
    layer, x, g = _layer_and_input()
    try:
        layers.set_slowdown(2.0)
        layer(x).backward(g)
    finally:
        layers.set_slowdown(1.0)
    assert sorted(sleeps) == pytest.approx(sorted([2 * F, 2 * B, 2 * W]))
    with pytest.raises(ValueError, match="at least 1"):
        layers.set_slowdown(0.5)


def test_layers_back_to_back_run_back_to_back_however_late_the_host_wakes(clock: _Clock) -> None:
    """Four layers' F in a row on a host that wakes 5 ms late from every sleep: the device ran them back to back, so
    the sleeps after the first are shorter by the lateness and the four end 4 F (plus the last wake-up) after the
    start, not 4 (F + 5 ms). After a pause of the host's own (a receive, a bubble) the next op starts then."""
    clock.late = 0.005
    start = clock.now
    for _ in range(4):
        layers._sleep(F)
    assert clock.made == pytest.approx([F, F - 0.005, F - 0.005, F - 0.005])
    assert clock.now - start == pytest.approx(4 * F + 0.005)
    clock.now += 0.010  # the host waits for a message
    layers._sleep(B)
    assert clock.made[-1] == pytest.approx(B)
    clock.late = 0.3  # wakes later than the next op lasts: that op ran meanwhile, no sleep for it at all
    layers._sleep(W)
    layers._sleep(0.1)
    assert clock.made[-1] == pytest.approx(W - 0.005) and len(clock.made) == 6
