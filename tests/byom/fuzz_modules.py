"""A seeded generator of random stage modules with the structures real models have, for the B/W split's fuzzing.

A stage is a chain of blocks over a ``(batch, width)`` hidden state; the chain may carry an integer mask beside
it (a tuple payload). Each block is drawn from the kinds below, and a container block nests more blocks, so
owners nest to any depth:

- ``linear``: an ``nn.Linear`` (optionally frozen);
- ``scaled``: a block with a parameter of its own used before or after its children (layer scale, positional
  table, ``cls_token``-like offsets);
- ``parallel``: one child called on two inputs, outputs combined;
- ``sequential``: one child applied to its own result;
- ``sibling_tied``: a child reading a sibling's weight directly (a parameter used outside its module's call);
- ``adapter``: a frozen base ``Linear`` beside a trainable low-rank adapter;
- ``checkpoint``: children inside ``torch.utils.checkpoint`` (non-reentrant, or reentrant);
- ``function``: a custom ``autograd.Function`` (returning None for a non-tensor argument);
- ``inplace``: a child's output changed in place after it returned;
- ``escape``: a child's output used twice, once inside the block and once beside it;
- ``shared``: two ``Linear`` modules holding one weight ``Parameter``;
- ``norm``: a ``LayerNorm``.

``random_blocks(seeds)`` strings several seeds' blocks together as the layer list of a ``PipelineModule``
(``models.py``'s ``fuzzed``).
"""
from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

__all__ = ["KINDS", "random_blocks", "random_stage"]

Hidden = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class _ScaleShift(torch.autograd.Function):
    """``x * a + shift`` with a float ``shift``: its backward returns None for the float."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, a: torch.Tensor, shift: float) -> torch.Tensor:
        ctx.save_for_backward(x, a)
        return x * a + shift

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, a = ctx.saved_tensors
        return grad * a, (grad * x).sum(0), None


class Chain(nn.Module):
    """Blocks applied in turn; a tuple payload's mask passes through untouched."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: Hidden) -> Hidden:
        h, mask = x if isinstance(x, tuple) else (x, None)
        for block in self.blocks:
            h = block(h)
        if mask is not None:
            h = h * (mask.unsqueeze(-1) > 0).to(h.dtype) + h * 0.5
        return (h, mask) if mask is not None else h


class Scaled(nn.Module):
    def __init__(self, width: int, child: nn.Module, before: bool) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(width) + 0.5)
        self.child, self.before = child, before

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child(x * self.scale) if self.before else self.child(x) * self.scale + x


class Parallel(nn.Module):
    def __init__(self, child: nn.Module) -> None:
        super().__init__()
        self.child = child

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child(x) + torch.tanh(self.child(x.flip(-1)))


class Sequential(nn.Module):
    def __init__(self, child: nn.Module) -> None:
        super().__init__()
        self.child = child

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child(torch.tanh(self.child(x)))


class SiblingTied(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) + torch.nn.functional.linear(x, self.a.weight) * 0.5


class Adapter(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.base = nn.Linear(width, width).requires_grad_(False)
        self.down, self.up = nn.Linear(width, 2, bias=False), nn.Linear(2, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


class Shared(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class Checkpointed(nn.Module):
    def __init__(self, child: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.child, self.reentrant = child, reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch_checkpoint.checkpoint(self.child, x, use_reentrant=self.reentrant)


class Function(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ScaleShift.apply(x, self.a, 0.25)


class InPlace(nn.Module):
    def __init__(self, child: nn.Module) -> None:
        super().__init__()
        self.child = child

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.child(x)
        return h.mul_(1.5).add_(x)


class Escape(nn.Module):
    """A child's output used inside a block of its own and beside it: the block's output does not cut it."""

    def __init__(self, width: int, child: nn.Module) -> None:
        super().__init__()
        self.inner = _Wrap(child, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        return out + self.inner.last * 0.5


class _Wrap(nn.Module):
    def __init__(self, child: nn.Module, width: int) -> None:
        super().__init__()
        self.child = child
        self.bias = nn.Parameter(torch.zeros(width))
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = self.child(x)
        return torch.tanh(self.last + self.bias)


def _linear(width: int, rng: random.Random) -> nn.Module:
    layer = nn.Linear(width, width, bias=rng.random() < 0.7)
    if rng.random() < 0.15:
        layer.requires_grad_(False)
    return layer


def _block(width: int, depth: int, rng: random.Random, kinds: list[str]) -> nn.Module:
    kind = rng.choice(kinds if depth > 0 else ["linear", "sibling_tied", "adapter", "function", "norm", "shared"])
    nested: Callable[[], nn.Module] = lambda: _block(width, depth - 1, rng, kinds)  # noqa: E731
    if kind == "linear":
        return _linear(width, rng)
    if kind == "norm":
        return nn.LayerNorm(width)
    if kind == "scaled":
        return Scaled(width, nested(), before=rng.random() < 0.5)
    if kind == "parallel":
        return Parallel(nested())
    if kind == "sequential":
        return Sequential(nested())
    if kind == "sibling_tied":
        return SiblingTied(width)
    if kind == "adapter":
        return Adapter(width)
    if kind == "checkpoint":
        return Checkpointed(Chain([nested() for _ in range(rng.randint(1, 2))]), reentrant=rng.random() < 0.3)
    if kind == "function":
        return Function(width)
    if kind == "shared":
        return Shared(width)
    if kind == "inplace":
        return InPlace(nested())
    if kind == "escape":
        return Escape(width, nested())
    if kind == "chain":
        return Chain([nested() for _ in range(rng.randint(1, 3))])
    raise AssertionError(kind)


KINDS = ["linear", "norm", "scaled", "parallel", "sequential", "sibling_tied", "adapter", "checkpoint", "function",
         "inplace", "escape", "chain", "shared"]


def random_stage(seed: int, width: int = 6, kinds: list[str] | None = None) -> tuple[nn.Module, bool]:
    """A random stage module and whether it takes a tuple ``(hidden, int mask)`` payload."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    blocks = [_block(width, rng.randint(0, 3), rng, kinds or KINDS) for _ in range(rng.randint(1, 4))]
    return Chain(blocks), rng.random() < 0.3


def random_blocks(seeds: range, width: int) -> list[nn.Module]:
    """The blocks of ``random_stage(seed, width)`` for each seed, in order (tensor payloads only)."""
    blocks: list[nn.Module] = []
    for seed in seeds:
        stage, _ = random_stage(seed, width)
        blocks.extend(stage.blocks)
    return blocks
