"""Fuzzing the B/W split: on random stage modules (``fuzz_modules``), B then W gives bit for bit the gradients one
fused backward gives, for every parameter and the stage input, micro-batch after micro-batch."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from ds_recycle.engine.backward import OwnerCapture, SplitUnsupported, WeightGradWork, backward_fused, backward_input
from tests.byom.fuzz_modules import random_stage

pytestmark = pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")

SEEDS = range(400)
MICRO_BATCHES = 2


def _inputs(seed: int, tuple_payload: bool, first: bool, width: int = 6) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(10_000 + seed)
    out = []
    for _ in range(MICRO_BATCHES):
        x = torch.randn(3, width, generator=gen)
        mask = torch.randint(0, 2, (3,), generator=gen)
        out.append((x, mask, torch.randn(3, width, generator=gen)))
    return out


def _leaf(x: torch.Tensor, mask: torch.Tensor, tuple_payload: bool, first: bool) -> tuple:
    xi = x.clone().requires_grad_(not first)
    return xi, ((xi, mask) if tuple_payload else xi)


def _output(out: object, last: bool) -> torch.Tensor:
    hidden = out[0] if isinstance(out, tuple) else out
    return (hidden * hidden).sum() / 2 if last else hidden


def _grads(stage: torch.nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in stage.parameters()]


def run_fused(seed: int, first: bool, last: bool) -> tuple[list, list]:
    stage, tuple_payload = random_stage(seed)
    input_grads = []
    for x, mask, g in _inputs(seed, tuple_payload, first):
        xi, payload = _leaf(x, mask, tuple_payload, first)
        out = _output(stage(payload), last)
        if out.requires_grad:
            out.backward(None if last else g)
        input_grads.append(None if first else xi.grad)
    return _grads(stage), input_grads


def run_split(seed: int, first: bool, last: bool) -> tuple[list, list, tuple[int, int] | None]:
    """F, F, B, B, W, W (W deferred past the other micro-batch's B, as a pipeline does); None: split refused."""
    stage, tuple_payload = random_stage(seed)
    capture = OwnerCapture(stage)
    forwards = []
    for x, mask, g in _inputs(seed, tuple_payload, first):
        xi, payload = _leaf(x, mask, tuple_payload, first)
        with capture.capture() as cap:
            out = _output(stage(payload), last)
        forwards.append((xi, out, None if last else g, cap))
    works: list[WeightGradWork] = []
    input_grads: list[torch.Tensor | None] = []
    kinds: tuple[int, int] | None = (0, 0)
    for xi, out, g, cap in forwards:
        stage_input = None if first else xi
        if not capture.fused:
            assert all(p.grad is None for p in stage.parameters()) or works == [], "B never accumulates"
            try:
                dx, work = backward_input(out, g, stage_input, cap, capture)
                assert all(p.grad is None for p in stage.parameters()), "B must not touch parameter gradients"
                works.append(work)
                input_grads.append(dx)
                kinds = tuple(a + b for a, b in zip(kinds, work.kinds()))  # type: ignore[assignment]
                continue
            except SplitUnsupported:
                capture.fused, kinds = True, None
        input_grads.append(backward_fused(out, g, stage_input, capture, plain=True))
    for work in works:
        work.run()
    return _grads(stage), input_grads, kinds


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("position", ["first", "middle", "last"])
def test_split_equals_fused_bit_for_bit_on_random_stages(position: str) -> None:
    first, last = position == "first", position == "last"
    paths: Counter[str] = Counter()
    for seed in SEEDS:
        want_params, want_inputs = run_fused(seed, first, last)
        got_params, got_inputs, kinds = run_split(seed, first, last)
        assert _same(got_params, want_params), f"seed {seed}: weight gradients differ ({position} stage)"
        assert _same(got_inputs, want_inputs), f"seed {seed}: input gradients differ ({position} stage)"
        paths["fused"if kinds is None else "rest" if kinds[1] else "per-owner"] += 1
    assert paths["per-owner"] > len(SEEDS) // 5 and paths["rest"] > 0 and paths["fused"] > 0, paths
