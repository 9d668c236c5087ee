"""The user script with the one-line change, under ``ds-recycle launch``: it ends at vanilla DeepSpeed's model.

The variant (:func:`~tests.byom.harness.recycle_variant`: ``import ds_recycle`` and ``ds_recycle.initialize(``)
runs on 4 processes (2 stages x 2 pipelines) and its final parameters are compared (rtol 1e-5) with the same
script's under torchrun and stock DeepSpeed, failure-free and with a worker SIGKILLed from outside mid-run.
DeepSpeed's topology numbers rank ``r`` as stage ``r // 2`` of pipeline ``r % 2``; the victims are in
pipeline 1, so pipeline 0, which gathers the final parameters, stays whole.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ds_recycle.events import FailureEvent, RejoinEvent, RepartitionEvent
from tests.byom.harness import (
    BYOM,
    RUN_TIMEOUT_S,
    STEPS,
    USER_TRAIN,
    VanillaRuns,
    assert_same_final,
    script_args,
    start_ds_recycle,
    start_torchrun,
    write_recycle_variant,
)

pytestmark = [pytest.mark.multiprocess]

KILL_AFTER_STEP = 6


@pytest.fixture(scope="module")
def variant(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_recycle_variant(USER_TRAIN, tmp_path_factory.mktemp("variant"))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("model", ["alexnet", "gpt", "tuple", "fuzzed"])
def test_failure_free_matches_vanilla(vanilla: VanillaRuns, variant: Path, tmp_path: Path, model: str) -> None:
    with start_ds_recycle(variant, script_args(model), tmp_path, pythonpath=(BYOM,)) as job:
        run = job.result(RUN_TIMEOUT_S).check()
    reference = vanilla(model)
    assert len(run.losses()) == STEPS, run.log[-3000:]
    assert run.losses() == pytest.approx(reference.losses(), rel=1e-5)
    assert_same_final(run.final, reference.final)
    assert run.jit_builds() == []


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("model", "victim", "launcher_args"), [
    # first stage: its peer also loads pipeline 1's data
    pytest.param("alexnet", 1, (), id="alexnet-first-stage"),
    # last stage: its peer computes pipeline 1's loss
    pytest.param("alexnet", 3, (), id="alexnet-last-stage"),
    # and the worker comes back and rejoins
    pytest.param("alexnet", 3, ("--restart_failed_after", "2"), id="alexnet-last-stage-rejoins"),
    # (hidden, bool mask) boundaries re-routed
    pytest.param("tuple", 3, (), id="tuple-last-stage"),
    # weights tied across the first and the last stage, a holder of either gone
    pytest.param("gpt", 1, (), id="tied-gpt-first-stage"),
    pytest.param("gpt", 3, (), id="tied-gpt-last-stage"),
])
def test_sigkill_mid_run_matches_vanilla(vanilla: VanillaRuns, variant: Path, tmp_path: Path, model: str,
                                        victim: int, launcher_args: tuple[str, ...]) -> None:
    with start_ds_recycle(variant, script_args(model), tmp_path, launcher_args=launcher_args,
                          pythonpath=(BYOM,)) as job:
        job.wait_for(rf"step {KILL_AFTER_STEP} loss", timeout=RUN_TIMEOUT_S)
        job.kill_rank(victim)
        run = job.result(2 * RUN_TIMEOUT_S).check()
    reference = vanilla(model)
    assert len(run.losses()) == STEPS, run.log[-3000:]
    assert run.losses() == pytest.approx(reference.losses(), rel=1e-5)
    assert_same_final(run.final, reference.final)


@pytest.mark.timeout(600)
def test_nested_owners_train_under_the_default_schedule_and_survive_a_kill(vanilla: VanillaRuns, variant: Path,
                                                                           tmp_path: Path) -> None:
    """A ViT whose modules own parameters beside their children (``cls_token``, an input scale used before the
    block's first ``Linear``, layer scales): failure-free and with a first-stage worker SIGKILLed, it ends at
    vanilla DeepSpeed's model, and the killed run at the failure-free one bit for bit."""
    with start_ds_recycle(variant, script_args("vit"), tmp_path / "free", pythonpath=(BYOM,)) as job:
        free = job.result(RUN_TIMEOUT_S).check()
    with start_ds_recycle(variant, script_args("vit"), tmp_path / "killed", pythonpath=(BYOM,)) as job:
        job.wait_for(rf"step {KILL_AFTER_STEP} loss", timeout=RUN_TIMEOUT_S)
        job.kill_rank(1)
        killed = job.result(2 * RUN_TIMEOUT_S).check()
    reference = vanilla("vit")
    assert killed.events(FailureEvent) and len(killed.losses()) == len(free.losses()) == STEPS
    assert free.losses() == pytest.approx(reference.losses(), rel=1e-5)
    assert_same_final(free.final, reference.final)
    assert killed.losses() == free.losses()
    assert_same_final(killed.final, free.final, rtol=0.0)


@pytest.mark.timeout(600)
def test_megatron_style_sampler_with_a_kill_matches_vanilla(variant: Path, tmp_path: Path) -> None:
    """``train_batch(data_iter=RepeatingLoader(DataLoader(batch_sampler=...)))`` with a sampler built from
    ``(total, consumed, micro_batch_size, data_parallel_rank, data_parallel_size)``, as Megatron-DeepSpeed's
    scripts build theirs, and ``engine.set_batch_fn`` post-processing them: the peer of a killed first-stage worker
    replays that pipeline's batches and runs the function on them, and the model ends at vanilla DeepSpeed's."""
    args = [*script_args("alexnet"), "--sampler", "shuffled"]
    with start_torchrun(USER_TRAIN, args, tmp_path / "vanilla") as job:
        reference = job.result(RUN_TIMEOUT_S).check()
    with start_ds_recycle(variant, args, tmp_path / "killed", pythonpath=(BYOM,)) as job:
        job.wait_for(rf"step {KILL_AFTER_STEP} loss", timeout=RUN_TIMEOUT_S)
        job.kill_rank(1)
        killed = job.result(2 * RUN_TIMEOUT_S).check()
    assert killed.events(FailureEvent) and len(killed.losses()) == STEPS
    assert killed.losses() == pytest.approx(reference.losses(), rel=1e-5)
    assert_same_final(killed.final, reference.final)


@pytest.mark.timeout(600)
def test_whole_stage_lost_falls_back_to_the_scripts_own_checkpoints(vanilla: VanillaRuns, variant: Path,
                                                                     tmp_path: Path) -> None:
    """Both workers of the last stage SIGKILLed at once: no peer holds the stage, so every rank restarts from the
    latest checkpoint the script itself saved (``engine.save_checkpoint``), although the script never loads one;
    its loop catches up and the run ends at vanilla DeepSpeed's model."""
    args = [*script_args("alexnet"), "--save-dir", str(tmp_path / "ckpt"), "--save-every", "4"]
    with start_ds_recycle(variant, args, tmp_path) as job:
        job.wait_for(rf"step {KILL_AFTER_STEP + 2} loss", timeout=RUN_TIMEOUT_S)
        job.kill_rank(2)
        job.kill_rank(3)
        run = job.result(3 * RUN_TIMEOUT_S).check()
    assert "falling back to the latest checkpoint" in run.log and "resumed from the checkpoint" in run.log
    assert_same_final(run.final, vanilla("alexnet").final)


@pytest.mark.timeout(600)
def test_dropout_model_with_a_failure_ends_as_without(variant: Path, tmp_path: Path) -> None:
    """Dropout draws from the micro-batch's own generator: a re-routed micro-batch gets the masks it would have had.

    (Not compared with vanilla DeepSpeed: its masks follow the order each process draws them in.)
    """
    with start_ds_recycle(variant, script_args("mlp"), tmp_path / "free", pythonpath=(BYOM,)) as job:
        free = job.result(RUN_TIMEOUT_S).check()
    with start_ds_recycle(variant, script_args("mlp"), tmp_path / "killed", pythonpath=(BYOM,)) as job:
        job.wait_for(rf"step {KILL_AFTER_STEP} loss", timeout=RUN_TIMEOUT_S)
        job.kill_rank(1)
        killed = job.result(2 * RUN_TIMEOUT_S).check()
    assert killed.events(FailureEvent) and len(killed.losses()) == STEPS
    assert killed.losses() == pytest.approx(free.losses(), rel=1e-5)
    assert_same_final(killed.final, free.final)


@pytest.mark.timeout(400)
def test_bf16_trains_with_a_falling_loss_as_vanilla_deepspeed(vanilla: VanillaRuns, variant: Path,
                                                             tmp_path: Path) -> None:
    """bf16 weights, fp32 master weights, fp32 gradient rows: the loss falls, and the run is vanilla DeepSpeed's.

    The vanilla run is the same script with ``configs/bf16-zero1.json``: DeepSpeed 0.19.8 accumulates a bf16
    pipeline's gradients in fp32 only with ZeRO stage 1 (``data_types.grad_accum_dtype`` fp32 is refused at stage
    0) and all-reduces them in fp32 with ``communication_data_type`` fp32; its partitioning of the master weights
    over the replicas does not change their values. The losses and the final parameters (bf16 weights, compared
    as floats) agree within rtol 1e-5 (on this machine they are bit-equal). DeepSpeed's stage-0 default
    (``configs/bf16.json`` there), which accumulates and all-reduces in bf16, is not compared: its sums round
    differently (about 10% of a weight's magnitude apart after 30 steps).
    """
    args = script_args("gpt", config="bf16")
    with start_ds_recycle(variant, args, tmp_path / "recycle", pythonpath=(BYOM,)) as job:
        run = job.result(RUN_TIMEOUT_S).check()
    losses = run.losses()
    assert len(losses) == STEPS, run.log[-3000:]
    assert sum(losses[-5:]) < 0.75 * sum(losses[:5]), losses
    layer = next((run.final.with_suffix(".ckpt") / "final").glob("layer_*-model_states.pt"))
    assert {t.dtype for t in torch.load(layer, weights_only=True).values()} == {torch.bfloat16}
    reference = vanilla("gpt", config="bf16-zero1")
    assert losses == pytest.approx(reference.losses(), rel=1e-5)
    assert_same_final(run.final, reference.final)
    assert run.jit_builds() == []


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("victim", "launcher_args", "steps"), [
    pytest.param(1, (), STEPS, id="first-stage"),
    # the restarted worker takes the fp32 master weights with the optimizer state from a live peer (enough steps
    # for its restart and admission: killed after step 6, it rejoined at iteration 22 on a 2-core machine)
    pytest.param(3, ("--restart_failed_after", "2"), 80, id="last-stage-rejoins"),
])
def test_bf16_with_a_sigkill_ends_as_without(variant: Path, tmp_path: Path, victim: int,
                                             launcher_args: tuple[str, ...], steps: int) -> None:
    """A bf16 run with a worker SIGKILLed mid-run ends at the failure-free bf16 run's parameters, bit for bit; never
    restarted, the tied GPT moves a block off the stage that lost it (the norm over every stage then gathered per
    parameter: a change of it by 1e-4 fails this test)."""
    args = script_args("gpt", config="bf16", steps=steps)
    with start_ds_recycle(variant, args, tmp_path / "free", pythonpath=(BYOM,)) as job:
        free = job.result(RUN_TIMEOUT_S).check()
    with start_ds_recycle(variant, args, tmp_path / "killed", launcher_args=launcher_args,
                          pythonpath=(BYOM,)) as job:
        job.wait_for(rf"step {KILL_AFTER_STEP} loss", timeout=RUN_TIMEOUT_S)
        job.kill_rank(victim)
        killed = job.result(2 * RUN_TIMEOUT_S).check()
    assert killed.events(FailureEvent) and len(killed.losses()) == steps, killed.log[-3000:]
    if launcher_args:
        assert killed.events(RejoinEvent), killed.log[-3000:]
    assert killed.losses() == pytest.approx(free.losses(), rel=1e-5)
    if not launcher_args:  # a lasting failure: a block left the first stage with its fp32 master and Adam state
        assert [(e.before, e.after) for e in killed.events(RepartitionEvent)][:1] == [((0, 4, 8), (0, 3, 8))]
    assert_same_final(killed.final, free.final, rtol=0.0)


@pytest.mark.timeout(400)
def test_fp16_is_refused_at_start_with_the_reason(variant: Path, tmp_path: Path) -> None:
    with start_ds_recycle(variant, script_args("gpt", config="fp16"), tmp_path, pythonpath=(BYOM,)) as job:
        run = job.result(RUN_TIMEOUT_S)
    assert run.returncode != 0
    assert "config key 'fp16.enabled'" in run.log and "loss scaling is not supported" in run.log, run.log[-3000:]
    assert "Fix:" in run.log


CHECKPOINTING = ("--activation-checkpoint-interval", "1")


@pytest.fixture(scope="module")
def vanilla_checkpointed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Vanilla DeepSpeed (its reentrant ``checkpointing.checkpoint``) on alexnet with activation_checkpoint_interval=1."""
    with start_torchrun(USER_TRAIN, [*script_args("alexnet"), *CHECKPOINTING],
                        tmp_path_factory.mktemp("vanilla-checkpointed")) as job:
        run = job.result(RUN_TIMEOUT_S).check()
    assert run.final is not None
    return run.final


@pytest.mark.timeout(600)
@pytest.mark.parametrize("victim", [None, 3], ids=["failure-free-config-eval", "last-stage-killed"])
def test_activation_checkpointing_matches_vanilla(vanilla_checkpointed: Path, variant: Path, tmp_path: Path,
                                                  victim: int | None) -> None:
    """Checkpointed segments recomputed by the non-reentrant checkpoint under the B/W split: vanilla's model.

    Failure-free, checkpointing is switched on in the config (``pipeline.activation_checkpoint_interval``, which
    DeepSpeed applies inside the engine) and the script ends with ``eval_batch``; killed, on the module."""
    args = script_args("alexnet", "fp32-checkpointed") + ["--eval"] if victim is None else [
        *script_args("alexnet"), *CHECKPOINTING]
    with start_ds_recycle(variant, args, tmp_path, pythonpath=(BYOM,)) as job:
        if victim is not None:
            job.wait_for(rf"step {KILL_AFTER_STEP} loss", timeout=RUN_TIMEOUT_S)
            job.kill_rank(victim)
        run = job.result(2 * RUN_TIMEOUT_S).check()
    assert len(run.losses()) == STEPS and (victim is None or run.events(FailureEvent)), run.log[-3000:]
    assert victim is not None or len(re.findall(r"eval rank \d loss \d", run.log)) == 4, run.log[-3000:]
    assert_same_final(run.final, vanilla_checkpointed)


@pytest.mark.timeout(600)
def test_recomputed_dropout_masks_are_the_forwards_with_a_failure(variant: Path, tmp_path: Path) -> None:
    """The dropout MLP checkpointed every layer, with a SIGKILL, ends as the failure-free run without checkpointing.

    Each recompute (in B and in W) restores the generator state the segment's forward started from, which is the
    micro-batch's own: the masks, hence the model, do not depend on checkpointing, on re-routing or on who runs B/W.
    """
    with start_ds_recycle(variant, script_args("mlp"), tmp_path / "plain", pythonpath=(BYOM,)) as job:
        plain = job.result(RUN_TIMEOUT_S).check()
    with start_ds_recycle(variant, [*script_args("mlp"), *CHECKPOINTING], tmp_path / "killed",
                          pythonpath=(BYOM,)) as job:
        job.wait_for(rf"step {KILL_AFTER_STEP} loss", timeout=RUN_TIMEOUT_S)
        job.kill_rank(1)
        killed = job.result(2 * RUN_TIMEOUT_S).check()
    assert killed.events(FailureEvent) and len(killed.losses()) == STEPS, killed.log[-3000:]
    assert killed.losses() == pytest.approx(plain.losses(), rel=1e-5)
    assert_same_final(killed.final, plain.final)


def _eval_losses(log: str) -> dict[int, float]:
    return {int(r): float(v) for r, v in re.findall(r"eval rank (\d+) loss (-?\d+\.\d{6})", log)}


@pytest.mark.timeout(600)
def test_eval_batch_with_an_absent_worker_matches_vanilla(variant: Path, tmp_path: Path) -> None:
    """``eval_batch`` over a DataLoader with a DistributedSampler: every rank gets the global mean, as in DeepSpeed."""
    args = [*script_args("alexnet", steps=8), "--eval"]
    with start_torchrun(USER_TRAIN, args, tmp_path / "vanilla") as job:
        vanilla = _eval_losses(job.result(RUN_TIMEOUT_S).check().log)
    with start_ds_recycle(variant, [*args[:-1], "--steps", "30", "--eval"], tmp_path / "killed") as job:
        job.wait_for(r"step 2 loss", timeout=RUN_TIMEOUT_S)
        job.kill_rank(1)
        killed = job.result(2 * RUN_TIMEOUT_S)
    with start_ds_recycle(variant, args, tmp_path / "free") as job:
        free = _eval_losses(job.result(RUN_TIMEOUT_S).check().log)
    assert sorted(vanilla) == [0, 1, 2, 3] and free == pytest.approx(vanilla, rel=1e-5)
    assert len(set(free.values())) == 1  # the mean over both pipelines' micro-batches, on every rank
    got = _eval_losses(killed.log)
    assert killed.events(FailureEvent) and sorted(got) == [0, 2, 3] and len(set(got.values())) == 1, killed.log[-3000:]


@pytest.mark.timeout(900)
def test_checkpoint_written_after_a_failure_loads_in_vanilla_and_resumes_the_stream(
        vanilla: VanillaRuns, variant: Path, tmp_path: Path) -> None:
    """Survivors write DeepSpeed's layout; ds_recycle resumes the same data stream, vanilla DeepSpeed loads it too."""
    with start_ds_recycle(variant, script_args("alexnet", steps=12), tmp_path / "killed") as job:
        job.wait_for(rf"step {KILL_AFTER_STEP} loss", timeout=RUN_TIMEOUT_S)
        job.kill_rank(3)
        first = job.result(2 * RUN_TIMEOUT_S).check()
    checkpoint = first.final.with_suffix(".ckpt")
    assert (checkpoint / "latest").read_text() == "final"
    resume = [*script_args("alexnet"), "--load", str(checkpoint)]
    with start_ds_recycle(variant, resume, tmp_path / "resumed") as job:
        resumed = job.result(RUN_TIMEOUT_S).check()
    reference = vanilla("alexnet")  # the uninterrupted STEPS-step run
    assert resumed.losses() == pytest.approx(reference.losses()[12:], rel=1e-5)
    assert_same_final(resumed.final, reference.final)
    with start_torchrun(USER_TRAIN, resume, tmp_path / "vanilla-loads") as job:
        loaded = job.result(RUN_TIMEOUT_S).check()
    assert len(loaded.losses()) == STEPS - 12 and all(loss == loss for loss in loaded.losses())
