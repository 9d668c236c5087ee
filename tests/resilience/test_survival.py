"""A worker SIGKILLed mid-training: the job goes on and ends at the failure-free model (rtol 1e-5).

Real jobs under ``ds-recycle launch`` (gloo, one thread per process), faults injected with ``--kill``;
final parameters compared with ``ds-recycle compare``. Each run costs ~10-20 s on 2 cores.
"""
from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from ds_recycle.events import Event, FailureEvent, RecoveredEvent, events_of  # noqa: E402
from tests.harness import assert_same_model, launch, tiny_config  # noqa: E402

STEPS = 7
pytestmark = [pytest.mark.multiprocess]


def _config(tmp: Path, name: str, stages: int, pipelines: int, faults: list | None = None) -> Path:
    return tiny_config(tmp, name, stages, pipelines, failure_timeout_s=60.0, faults=faults)


def _train(tmp: Path, config: Path, nproc: int, name: str, kills: list[str] = ()) -> tuple[Path, str, list[dict]]:
    out, metrics = tmp / f"{name}.pt", tmp / f"{name}.jsonl"
    args = ["--deepspeed_config", str(config), "--steps", str(STEPS), "--save-final", str(out),
            "--metrics", str(metrics)]
    for k in kills:
        args += ["--kill", k]
    job = launch(nproc, args, timeout=120)
    assert job.returncode == 0, job.output[-5000:]
    records = job.metrics(metrics) if metrics.exists() else []
    return out, job.output, records


@pytest.fixture(scope="module")
def baseline_2x2(reference: Callable[[int, int, int], Path]) -> Path:
    return reference(2, 2, STEPS)


# Every phase covered once in the first stage and once in the last. Each job kills one worker of each stage, the
# second two iterations or more after the first (which has recovered by then): the first kill of a pair meets a
# failure-free job, the second one a job already running re-routed; both must end at the failure-free model.
# (kill, worker's rank in the 2 x 2 layout), first and second.
KILLS_2X2 = [(("1:0@2:forward", 1), ("1:1@4:idle", 3)), (("1:0@3:backward-weight", 1), ("1:1@5:send", 3)),
             (("1:0@2:all-reduce", 1), ("1:1@4:backward-input", 3)), (("1:1@2:receive", 3), ("0:0@4:optimizer-step", 0))]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("kills", KILLS_2X2, ids=[f"{a[0]}+{b[0]}" for a, b in KILLS_2X2])
def test_2x2_one_worker_of_each_stage_killed_in_turn_same_model(tmp_path: Path, baseline_2x2: Path,
                                                                 kills: tuple[tuple[str, int], ...]) -> None:
    out, output, records = _train(tmp_path, _config(tmp_path, "k", 2, 2), 4, "k", [k for k, _ in kills])
    for _, rank in kills:
        assert re.search(rf"rank {rank} \(pid \d+\) lost: signal SIGKILL", output), output[-3000:]
    assert_same_model(out, baseline_2x2)
    # The reporter (worker (0, 1)) survives: every event is in its metrics file, each failure recovered in turn.
    kinds = [e.kind for e in events_of(records, Event) if e.kind != "roll_forward"]  # (rare: a replica brought up)
    assert kinds == ["failure", "agreement", "plan_switch", "recovered"] * 2, kinds
    assert [f.lost_ranks for f in events_of(records, FailureEvent)] == [(rank,) for _, rank in kills]
    assert all(0 < r.failure_to_full_iteration_s < 30 for r in events_of(records, RecoveredEvent))
    assert records[-1]["live_workers"] == 2 and records[-1]["rerouted_microbatches"] > 0


@pytest.fixture(scope="module")
def baseline_3x2(reference: Callable[[int, int, int], Path]) -> Path:
    return reference(3, 2, STEPS)


# The middle stage of a 3 x 2 job (worker (1, 1) is rank 3), every phase.
KILLS_MIDDLE = ["1:1@2:forward", "1:1@3:backward-input", "1:1@2:backward-weight", "1:1@3:send", "1:1@2:receive",
                "1:1@3:all-reduce", "1:1@4:optimizer-step", "1:1@3:idle"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kill", KILLS_MIDDLE)
def test_3_stages_middle_stage_killed_same_model(tmp_path: Path, baseline_3x2: Path, kill: str) -> None:
    out, output, records = _train(tmp_path, _config(tmp_path, "k3", 3, 2), 6, "k3", [kill])
    assert "rank 3 (pid" in output and "lost: signal SIGKILL" in output, output[-3000:]
    assert [e.lost_workers for e in events_of(records, FailureEvent)] == [((1, 1),)]
    assert_same_model(out, baseline_3x2)


@pytest.mark.timeout(200)
def test_3_stages_last_stage_killed_at_its_last_weight_gradient_same_model(tmp_path: Path, baseline_3x2: Path) -> None:
    """The last stage's deferred W's run while the first stages step: a worker killed at its last W leaves the
    first stages committed (nothing of the iteration runs there again); its stage finishes the iteration with the
    activations it lost taken from boundary logs. Which stages had stepped depends on timing; the model does not."""
    out, output, records = _train(tmp_path, _config(tmp_path, "k3w", 3, 2), 6, "k3w", ["1:2@3:last-backward-weight"])
    recovered = events_of(records, RecoveredEvent)
    assert len(recovered) == 1 and recovered[0].repair_iteration == 3, recovered
    print("committed stages", recovered[0].committed_stages, "tensors from logs", recovered[0].tensors_from_logs)
    assert_same_model(out, baseline_3x2)


# 3 and 4 pipelines (one, two at once, and cascading failures, bit-identical): tests/resilience/test_hard_faults.py


@pytest.mark.timeout(150)
@pytest.mark.parametrize("kill,rank,failure", [(f"1:0@{STEPS}:end-of-training", 1, True),
                                               (f"0:0@{STEPS}:ended", 0, False)], ids=["before", "after"])
def test_a_death_at_the_end_of_training_ends_the_job_at_the_same_model(tmp_path: Path, baseline_2x2: Path, kill: str,
                                                                       rank: int, failure: bool) -> None:
    """Killed after its last iteration, before its last step is final: the others recover and finish again. Killed
    once the members agreed that training is over (worker (0, 0) had written stage 0's final parameters): nothing is
    recovered, the others end as they would have. Either way the job succeeds with the failure-free model."""
    out, output, records = _train(tmp_path, _config(tmp_path, "end", 2, 2), 4, "end", [kill])
    assert re.search(rf"rank {rank} \(pid \d+\) lost: signal SIGKILL", output), output[-3000:]
    assert [e.lost_ranks for e in events_of(records, FailureEvent)] == ([(rank,)] if failure else []), output[-3000:]
    assert_same_model(out, baseline_2x2)


@pytest.mark.timeout(150)
def test_2x2_two_failures_in_different_stages(tmp_path: Path, baseline_2x2: Path) -> None:
    out, output, records = _train(tmp_path, _config(tmp_path, "k", 2, 2), 4, "k",
                                  ["1:0@2:backward-input", "0:1@4:receive"])
    assert output.count("lost: signal SIGKILL") >= 2
    assert_same_model(out, baseline_2x2)


@pytest.mark.timeout(200)
def test_whole_stage_lost_falls_back_to_the_checkpoint(tmp_path: Path, baseline_2x2: Path) -> None:
    """Both workers of the last stage die at once: every rank restarts from the iteration-4 checkpoint, with the
    checkpoint flags alone (no --resume, no --restart_failed_after), and the metrics file keeps one record."""
    out, metrics = tmp_path / "fb.pt", tmp_path / "fb.jsonl"
    args = ["--deepspeed_config", str(_config(tmp_path, "fb", 2, 2)), "--steps", str(STEPS), "--save-final", str(out),
            "--metrics", str(metrics), "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-interval", "2",
            "--kill", "0:1@5:forward", "--kill", "1:1@5:backward-input"]
    job = launch(4, args, timeout=180)
    assert job.returncode == 0, job.output[-5000:]
    left_as_lost = len(re.findall(r"summary: rank \d \(pid \d+\) lost: exit code 75", job.output))
    restarted_ok = len(re.findall(r"summary: rank \d \(pid \d+, restart 1\) finished: exit code 0", job.output))
    assert (left_as_lost, restarted_ok) == (2, 4), job.output[-3000:]
    records = job.metrics(metrics)  # one file: the first life's iterations, then the restarted job's from 4 on
    assert [r["iter"] for r in records] == [0, 1, 2, 3, 4, 4, 5, 6], [r["iter"] for r in records]
    kinds = [e.kind for e in events_of(records[5:6], Event)]  # the two deaths are seen in one agreement round or two
    assert kinds[0] == "failure" and kinds[-2:] == ["fallback", "resumed"], kinds
    lost = sorted(w for e in events_of(records[5:6], FailureEvent) for w in e.lost_workers)
    # both killed workers; a survivor that left for the fallback first may be seen gone by the last one too
    assert {(0, 1), (1, 1)} <= {tuple(w) for w in lost} <= {(0, 1), (1, 1), (0, 0), (1, 0)}, lost
    assert_same_model(out, baseline_2x2)


@pytest.mark.timeout(200)
def test_whole_stage_lost_without_a_checkpoint_dir_says_so(tmp_path: Path) -> None:
    args = ["--deepspeed_config", str(_config(tmp_path, "nofb", 2, 2)), "--steps", str(STEPS),
            "--kill", "0:1@3:forward", "--kill", "1:1@3:forward"]
    job = launch(4, args, timeout=150)
    assert job.returncode == 1, job.output[-3000:]
    assert "falling back" not in job.output and "no checkpoint to fall back to" in job.output, job.output[-3000:]


@pytest.mark.timeout(150)
def test_reporter_killed_next_last_stage_worker_continues_the_metrics(tmp_path: Path, baseline_2x2: Path) -> None:
    out, output, records = _train(tmp_path, _config(tmp_path, "r", 2, 2), 4, "r", ["0:1@3:forward"])
    assert "this rank reports from now on" in output, output[-3000:]
    assert [r["iter"] for r in records] == list(range(STEPS))
    assert [e.kind for e in events_of(records[3:4], Event)][:2] == ["failure", "agreement"]
    assert events_of(records[3:4], FailureEvent)[0].lost_workers == ((0, 1),) and records[-1]["live_workers"] == 3
    assert_same_model(out, baseline_2x2)
