"""The user-style script on stock DeepSpeed: each model trains, repeats bit for bit, and the launchers agree.

These runs are the references of ``test_recycle_scripts.py``. Budget: 8 four-process runs of 20 steps (torchrun
once for every model and again for two of them, DeepSpeed's launcher and bf16 once each), each 10-25 s on an idle
2-core machine (about 2 minutes in all; 5 minutes when other jobs share the machine).
"""
from __future__ import annotations

import pytest

from tests.byom.harness import STEPS, Run, VanillaRuns, identical

MODELS = ["alexnet", "gpt", "tuple", "mlp"]

pytestmark = pytest.mark.multiprocess


def _falls(losses: list[float]) -> bool:
    """The mean of the last three losses is at most 80% of the mean of the first three."""
    return sum(losses[-3:]) <= 0.8 * sum(losses[:3])


def _no_jit(run: Run) -> None:
    assert run.jit_builds() == [], f"DeepSpeed compiled ops: {run.jit_builds()}"
    assert "Loading extension module" not in run.log and "built successfully" not in run.log, run.log[-3000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", MODELS)
def test_trains(vanilla: VanillaRuns, model: str) -> None:
    run = vanilla(model)
    losses = run.losses()
    assert len(losses) == STEPS, run.log[-3000:]
    assert _falls(losses), f"{model} did not learn: {losses}"
    _no_jit(run)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_repeats_bit_for_bit(vanilla: VanillaRuns, model: str) -> None:
    """Tied weights (gpt) and dropout (mlp): the stack under the references is deterministic."""
    first, second = vanilla(model), vanilla(model, repeat=1)
    assert second.losses() == first.losses()
    assert identical(first.final, second.final), f"two runs of {model} ended at different parameters"


@pytest.mark.timeout(300)
def test_deepspeed_launcher_gives_the_torchrun_model(vanilla: VanillaRuns) -> None:
    """The dropout model: also the RNG streams must be the same under both launchers."""
    under_ds, under_torchrun = vanilla("mlp", launcher="deepspeed"), vanilla("mlp")
    assert under_ds.losses() == under_torchrun.losses()
    assert identical(under_ds.final, under_torchrun.final)
    _no_jit(under_ds)


@pytest.mark.timeout(300)
def test_bf16_gpt_trains(vanilla: VanillaRuns) -> None:
    """The bf16 reference of ``test_recycle_scripts.py`` (ZeRO stage 1, fp32 gradient accumulation) learns."""
    bf16, fp32 = vanilla("gpt", config="bf16-zero1"), vanilla("gpt")
    assert _falls(bf16.losses()), bf16.losses()
    assert bf16.losses() != fp32.losses(), "the bf16 config trained exactly as fp32: is bf16 on?"
    _no_jit(bf16)
