"""A pipeline layer that spends the time of a cost profile in F, B and W, and almost no CPU.

:class:`EmulatedLayer` computes ``out = x + w`` (``w`` a tiny real parameter, so gradients exist and the
optimizer step and the gradient all-reduce run for real) through two autograd nodes:

- the *input path* (:class:`_InputPath`, on ``x``): its forward sleeps F, its backward sleeps B;
- the *weight path* (:class:`_WeightPath`, on ``w``): its backward sleeps W.

Autograd runs only the nodes on a path to the tensors it is asked for, so a backward that wants the input's
gradient alone (ZB's B: ``torch.autograd.grad(out, x)``) runs the input path and sleeps B, one that wants
the weights alone (ZB's W: ``backward(out, grad, inputs=[w])``) runs the weight path and sleeps W, and the
fused backward of vanilla DeepSpeed (``backward(loss)``) runs both and sleeps B + W. No node depends on how
``ctx.needs_input_grad`` was set at forward time, which does not change between the two halves.

B is paid whenever autograd wants a gradient *below* the layer: the layer's input, or the output of an
earlier module with parameters. On a first stage whose input is token ids, put a real module with
parameters before it (an embedding, as in every GPT); otherwise nothing below needs B and it is skipped,
as it would be on an accelerator.

Sleeps are wall-clock (``time.sleep`` gives up the core), so a worker in a bubble is idle. The real work of
the layer (an add of a ``[*, width]`` tensor) is microseconds; the sleep is not shortened by it.

**Ops back to back run back to back.** On an accelerator a stage's kernels queue and run one after the other
whatever the host's scheduler does; a sleeping process, though, wakes late when the machine is loaded (several
workers a core), and a stage of 32 layers pays that latency 32 times per F. So the layers keep the emulated
device's timeline: an op that the host issues within ``BACK_TO_BACK_S`` of waking from the previous one (nothing of
its own in between: the next layer of the same F, B or W) starts when the previous op *ended on the device*, not
when the host woke, and its sleep is shorter by the lateness. Anything longer in between (a receive, the optimizer,
a bubble) starts the next op at the host's time, as before. The lateness is load-dependent noise, not device time;
without this a busy machine inflated every multi-layer op by its wake-ups.

A slow accelerator (fail-slow: throttling, a noisy neighbour) is emulated by :func:`set_slowdown`: every sleep of
this process's layers from then on is ``factor`` times longer, whatever micro-batch it runs. Timing noise is
emulated by :func:`set_jitter`: every sleep is scaled by its own factor drawn uniformly from ``[1 - j, 1 + j]``
(seeded, so a run's noise can be replayed).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["OpCost", "EmulatedLayer", "set_jitter", "set_slowdown"]

_SLOWDOWN = [1.0]
_JITTER: list[tuple[float, random.Random]] = []
BACK_TO_BACK_S = 0.002
"""An op issued within this long of the host waking from the previous one runs back to back with it."""
_DEVICE = [float("-inf"), float("-inf")]
"""When the emulated device finished its last op, and when the host woke from waiting for it."""


def set_slowdown(factor: float) -> None:
    """Make this process's emulated accelerator ``factor`` times slower (1.0: its normal speed)."""
    if not factor >= 1.0:
        raise ValueError(f"slowdown factor {factor}: must be at least 1")
    _SLOWDOWN[0] = float(factor)


def set_jitter(fraction: float, seed: int) -> None:
    """Scale each of this process's emulated op times by a factor drawn uniformly from ``[1 - fraction,
    1 + fraction]`` (0: no noise)."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"jitter {fraction}: must be in [0, 1)")
    _JITTER[:] = [(fraction, random.Random(seed))] if fraction else []


def _sleep(seconds: float) -> None:
    """The emulated device runs an op of ``seconds`` (scaled by the slowdown and the jitter); the host waits for it."""
    if seconds > 0:
        noise = 1.0
        if _JITTER:
            fraction, rng = _JITTER[0]
            noise = 1.0 + rng.uniform(-fraction, fraction)
        duration = seconds * _SLOWDOWN[0] * noise
        now = time.monotonic()
        last_end, woke = _DEVICE
        start = last_end if now - woke < BACK_TO_BACK_S else now
        lag = now - start  # how far the host is behind the device's timeline
        if duration > lag:
            time.sleep(duration - lag)
        _DEVICE[:] = [start + duration, time.monotonic()]


@dataclass(frozen=True)
class OpCost:
    """Wall-clock seconds of one micro-batch's F, B (input gradient) and W (weight gradient) in one layer."""

    f: float
    b: float
    w: float

    def __post_init__(self) -> None:
        for name in ("f", "b", "w"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"OpCost.{name} = {value}: a duration in seconds must be >= 0")


class _InputPath(torch.autograd.Function):
    """Identity on ``x``; forward sleeps F, backward sleeps B."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, f: float, b: float) -> torch.Tensor:  # type: ignore[override]
        ctx.b = b
        _sleep(f)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        _sleep(ctx.b)
        return grad, None, None


class _WeightPath(torch.autograd.Function):
    """Identity on ``w``; backward sleeps W."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, seconds: float) -> torch.Tensor:  # type: ignore[override]
        ctx.w = seconds
        return w.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        _sleep(ctx.w)
        return grad, None


class EmulatedLayer(nn.Module):
    """``out = x + weight`` over the last dimension, with F, B and W taking ``cost``'s wall-clock time.

    ``x`` is a float tensor ``[..., width]``; ``weight`` (``width`` values, zeros at start) is the layer's
    only parameter. ``EmulatedLayer(f=0.1, b=0.1, w=0.08, width=16)`` or ``EmulatedLayer(cost=OpCost(...))``.
    """

    def __init__(self, f: float = 0.0, b: float = 0.0, w: float = 0.0, width: int = 16,
                 cost: OpCost | None = None) -> None:
        super().__init__()
        self.cost = cost if cost is not None else OpCost(f, b, w)
        self.weight = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():
            raise TypeError(f"EmulatedLayer takes a float activation, got {x.dtype}: put an embedding before it")
        y = _InputPath.apply(x, self.cost.f, self.cost.b)
        z = _WeightPath.apply(self.weight, self.cost.w)
        return y + z

    def extra_repr(self) -> str:
        c = self.cost
        return f"width={self.weight.numel()}, F={c.f * 1e3:g} ms, B={c.b * 1e3:g} ms, W={c.w * 1e3:g} ms"
