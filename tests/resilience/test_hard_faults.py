"""Hard faults sent from outside the training processes, as a cluster would: the final model is the failure-free one.

A harness starts ``ds-recycle launch`` on the default GPT's training script (tiny sizes), finds the workers'
pids through ``/proc`` and signals them: SIGSTOP (a hung worker), SIGCONT, SIGKILL. Every job is bounded in
time and nothing of it outlives the test (:mod:`tests.launcher.launch_harness`).

- a worker stopped for good is declared failed within ``heartbeat_stale_s`` and fenced by its launcher; one
  stopped for less than that and resumed is declared nothing;
- a restarted worker that dies at any step of its admission is an ordinary failure: the members carry on and
  its next process joins. To give each restarted process time to start on a loaded machine, the harness
  SIGSTOPs the members while it starts up (``heartbeat_stale_s`` is set well above that pause) and resumes
  them once it has filed its join request;
- 3 and 4 pipelines: single, double and cascading kills end bit-identical to the failure-free run.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from ds_recycle.events import FailureEvent, RejoinEvent, ResumedEvent, events_of  # noqa: E402
from tests.harness import assert_same_model, launch, tiny_config  # noqa: E402
from tests.launcher.launch_harness import LaunchedJob, assert_no_survivors  # noqa: E402

pytestmark = [pytest.mark.multiprocess]

STEPS = 100
"""Long enough that the members still train when a restarted process has started (they run freely for the
launcher's restart delay after each death)."""
STALE_S = 3.0
"""heartbeat_stale_s of the hung-worker tests."""
DETECTION_MARGIN_S = 3.0
"""Slack over heartbeat_stale_s for the watchdog's period (0.25 s) and a loaded 2-core machine."""


def _script(config: Path, out: Path, metrics: Path, steps: int, *extra: str) -> list[str]:
    return [str(REPO / "launch" / "train.py"), "--deepspeed_config", str(config), "--steps", str(steps),
            "--save-final", str(out), "--metrics", str(metrics), *extra]


def _start(nproc: int, script: list[str], launcher_args: tuple[str, ...] = ()) -> LaunchedJob:
    return LaunchedJob(["--num_accelerators", str(nproc), "--master_port", "0", *launcher_args, *script],
                       env={"WANDB_MODE": "disabled"})


def _records(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def _wait_for_iteration(job: LaunchedJob, metrics: Path, iteration: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(r["iter"] >= iteration for r in _records(metrics)):
        if time.monotonic() > deadline or job.proc.poll() is not None:
            pytest.fail(f"iteration {iteration} not reached; output:\n{job.text[-4000:]}")
        time.sleep(0.05)


def _signal(job: LaunchedJob, ranks: list[int], sig: signal.Signals) -> None:
    job.signal_ranks(ranks, sig)


def _finish(job: LaunchedJob, timeout_s: float = 200.0) -> None:
    try:
        code = job.finish(timeout_s)
        assert code == 0, job.text[-5000:]
        assert_no_survivors(job)
    finally:
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def baseline(reference: Callable[[int, int, int], Path]) -> Path:
    return reference(2, 2, STEPS)


# ------------------------------------------------------------------------------------------------ a hung worker
@pytest.mark.timeout(300)
def test_a_short_stop_declares_nothing_and_a_hung_worker_is_declared_within_heartbeat_stale_s_and_fenced(
        tmp_path: Path, baseline: Path) -> None:
    """Two stops of worker (1, 0) in one job. Stopped for a third of ``heartbeat_stale_s`` and resumed, it is declared
    nothing (its heartbeat resumes with it). Stopped for good, the survivors blocked in waits on it, it is declared
    failed within ``heartbeat_stale_s`` and fenced (SIGKILLed) by its launcher; the model is the failure-free one."""
    # fail-slow off: on an oversubscribed 2-core machine 100 iterations can show a worker 1.3x slower than its peer
    # for long enough to be planned around (a real slowdown there, not a hang), and this test asserts no events
    config = tiny_config(tmp_path, "c", 2, 2, failure_timeout_s=120.0, heartbeat_stale_s=STALE_S,
                         fail_slow={"enabled": False})
    out, metrics = tmp_path / "hung.pt", tmp_path / "hung.jsonl"
    job = _start(4, _script(config, out, metrics, STEPS))
    try:
        _wait_for_iteration(job, metrics, 5)
        _signal(job, [1], signal.SIGSTOP)
        time.sleep(STALE_S / 3)
        _signal(job, [1], signal.SIGCONT)
        resumed = max(r["iter"] for r in _records(metrics))
        _wait_for_iteration(job, metrics, resumed + 10)  # well past the short stop: whatever it caused has happened
        assert "fencing" not in job.text and "watchdog:" not in job.text, job.text[-3000:]
        assert not [e for r in _records(metrics) for e in r["events"]]
        _signal(job, [1], signal.SIGSTOP)  # left stopped: the survivors block in waits on it
        stopped_at = time.time()
        job.wait_for(r"fencing rank 1 \(pid \d+\): no heartbeat", timeout_s=60)
    finally:
        _finish(job)
    assert re.search(r"summary: rank 1 \(pid \d+\) lost: signal SIGKILL", job.text), job.text[-3000:]
    records = _records(metrics)
    (failure,) = events_of(records, FailureEvent)
    assert failure.lost_ranks == (1,) and "hung: no heartbeat" in failure.reason, failure
    detection_s = failure.time_s - stopped_at
    # the last heartbeat came at most one period (0.2 s) before the stop, the declaration heartbeat_stale_s later
    assert STALE_S - 0.3 < detection_s < STALE_S + DETECTION_MARGIN_S, detection_s
    assert len(records) == STEPS and records[-1]["live_workers"] == 3
    assert_same_model(out, baseline)


# ------------------------------------------------------------------------------------------------ joiner deaths
JOIN_STALE_S = 240.0
"""The members are paused while a restarted process starts (at most ``JOIN_STARTUP_S``): far below this, so
nobody is declared hung, and below ``failure_timeout_s``, so no wait runs out."""
JOIN_STARTUP_S = 150.0


def _member_pause(job: LaunchedJob, restart: int) -> contextlib.AbstractContextManager[None]:
    """Pause the members while restart ``restart`` of rank 1 starts up; yield once it filed its join request."""
    return job.members_paused(1, restart, [0, 2, 3], timeout_s=JOIN_STARTUP_S)


def _joiner_job(tmp_path: Path, *kills: str) -> tuple[LaunchedJob, Path, Path]:
    """Worker (1, 0) killed at iteration 2; the launcher restarts it (up to 3 times) a second after each death."""
    config = tiny_config(tmp_path, "c", 2, 2, failure_timeout_s=300.0, heartbeat_stale_s=JOIN_STALE_S)
    out, metrics = tmp_path / "j.pt", tmp_path / "j.jsonl"
    extra = ["--kill", "1:0@2:backward-input", *[a for k in kills for a in ("--kill", k)]]
    job = _start(4, _script(config, out, metrics, STEPS, *extra), ("--restart_failed_after", "1", "--max_restarts", "3"))
    return job, out, metrics


def _kill_job(job: LaunchedJob) -> None:
    if job.proc.poll() is None:
        os.killpg(job.proc.pid, signal.SIGKILL)


def _check_joiner_deaths(job: LaunchedJob, out: Path, metrics: Path, baseline: Path, reasons: list[str | None],
                         killed_at: list[float | None]) -> None:
    """Restarts 1 and 2 of rank 1 died during their admission, restart 3 joined: each death was an ordinary failure
    (seen at once, not after ``failure_timeout_s``), the members went on, and the model is the failure-free one."""
    _finish(job)
    for restart in (1, 2):
        assert re.search(rf"summary: rank 1 \(pid \d+, restart {restart}\) lost: signal SIGKILL", job.text), (
            job.text[-3000:])
    assert re.search(r"summary: rank 1 \(pid \d+, restart 3\) finished: exit code 0", job.text), job.text[-3000:]
    records = _records(metrics)
    failures = events_of(records, FailureEvent)
    assert [f.lost_ranks for f in failures] == [(1,)] * 3, failures  # the first kill, then the two joiners' deaths
    for failure, reason, at in zip(failures[1:], reasons, killed_at):
        if reason is not None:
            assert reason in failure.reason, failure
        if at is not None:
            assert failure.time_s - at < 30, failure.time_s - at
    joins = events_of(records, RejoinEvent)  # the third attempt (a death in its first iteration joined before)
    assert joins and joins[-1].ranks == (1,) and records[-1]["live_workers"] == 4, joins
    assert len(records) == STEPS
    assert_same_model(out, baseline)


@pytest.mark.timeout(600)
def test_joiners_killed_after_filing_their_request_and_while_the_groups_are_being_built(tmp_path: Path,
                                                                                      baseline: Path) -> None:
    """Restart 1 is SIGKILLed once its join request is filed (the members decide it at their next boundary); restart 2
    is admitted but stopped before it connects to the join's groups, then SIGKILLed; restart 3 joins."""
    job, out, metrics = _joiner_job(tmp_path)
    try:
        with _member_pause(job, 1):
            _signal(job, [1], signal.SIGKILL)
            first = time.time()
        with _member_pause(job, 2):
            _signal(job, [1], signal.SIGSTOP)  # admitted, but it never connects to the join's groups
        time.sleep(3.0)  # the members reach their boundary, admit it and wait for its connection
        _signal(job, [1], signal.SIGKILL)
        second = time.time()
        with _member_pause(job, 3):
            pass
        job.wait_for(r"joined the running job at iteration", timeout_s=120)
    except BaseException:
        _kill_job(job)
        raise
    _check_joiner_deaths(job, out, metrics, baseline, [None, "building epoch"], [first, second])


@pytest.mark.timeout(600)
def test_joiners_killed_in_the_state_transfer_and_in_their_first_iteration(tmp_path: Path, baseline: Path) -> None:
    """Restart 1 dies as it receives its stage's state, restart 2 in its first iteration in the running job (it had
    joined), restart 3 joins: the ``join-*`` faults fire in the life their iteration names."""
    job, out, metrics = _joiner_job(tmp_path, "1:0@1:join-transfer", "1:0@2:join-first-iteration")
    try:
        for restart, phase in ((1, "join-transfer"), (2, "join-first-iteration")):
            with _member_pause(job, restart):
                pass
            job.wait_for(rf"fault injection: killing this worker \(1:0@{restart}:{phase}\)", timeout_s=120)
        with _member_pause(job, 3):
            pass
        job.wait_for(r"joined the running job at iteration", count=2, timeout_s=120)
    except BaseException:
        _kill_job(job)
        raise
    _check_joiner_deaths(job, out, metrics, baseline, [None, None], [None, None])


# ------------------------------------------------------------------------------------------------ 3 and 4 pipelines
D_STEPS = 16


@pytest.fixture(scope="module")
def baselines_d(reference: Callable[[int, int, int], Path]) -> dict[int, Path]:
    return {d: reference(2, d, D_STEPS) for d in (3, 4)}


# (pipelines, [(rank, delay after the previous kill)]); ranks are stage-major: (p, s) is rank s * D + p.
# 2x3-whole-pipeline: pipeline 0 lost at both stages, its micro-batches spread over both survivors at both stages.
KILLS = [(3, [(1, 0.0)]), (3, [(1, 0.0), (2, 0.0)]), (3, [(1, 0.0), (5, 0.3)]), (3, [(1, 0.0), (2, 0.3)]),
         (3, [(0, 0.0), (3, 0.0)]), (4, [(2, 0.0)]), (4, [(1, 0.0), (6, 0.3)])]
IDS = ["2x3-single", "2x3-double", "2x3-cascade-other-stage", "2x3-cascade-same-stage", "2x3-whole-pipeline",
       "2x4-single", "2x4-cascade"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("pipelines,kills", KILLS, ids=IDS)
def test_any_number_of_pipelines_ends_bit_identical(tmp_path: Path, baselines_d: dict[int, Path], pipelines: int,
                                                    kills: list[tuple[int, float]]) -> None:
    config = tiny_config(tmp_path, "c", 2, pipelines, failure_timeout_s=120.0)
    out, metrics = tmp_path / "k.pt", tmp_path / "k.jsonl"
    job = _start(2 * pipelines, _script(config, out, metrics, D_STEPS))
    try:
        _wait_for_iteration(job, metrics, 2)
        for rank, delay in kills:
            time.sleep(delay)
            _signal(job, [rank], signal.SIGKILL)
    finally:
        _finish(job, 300)
    records = _records(metrics)
    lost = sorted(r for e in events_of(records, FailureEvent) for r in e.lost_ranks)
    assert lost == sorted(r for r, _ in kills), lost
    assert records[-1]["live_workers"] == 2 * pipelines - len(kills)
    assert_same_model(out, baselines_d[pipelines])


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.timeout(200)
def test_misspelt_section_under_the_launcher_is_one_error(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, "c", 2, 2)
    raw = json.loads(config.read_text())
    raw["recyle"] = raw.pop("recycle")
    config.write_text(json.dumps(raw))
    job = launch(4, ["--deepspeed_config", str(config), "--steps", "2"], timeout=150)
    assert job.returncode != 0
    assert job.output.count("did you mean 'recycle'?") == 1, job.output[-3000:]


# ------------------------------------------------------------------------------------------------ manual resume
@pytest.mark.timeout(300)
def test_manual_resume_appends_to_the_metrics_with_a_resumed_event(tmp_path: Path) -> None:
    config, metrics, ckpt = tiny_config(tmp_path, "c", 2, 2), tmp_path / "m.jsonl", tmp_path / "ck"
    common = ["--deepspeed_config", str(config), "--metrics", str(metrics), "--checkpoint-dir", str(ckpt)]
    first = launch(4, [*common, "--steps", "4", "--checkpoint-interval", "2"], timeout=150)
    assert first.returncode == 0, first.output[-3000:]
    again = launch(4, [*common, "--steps", "5", "--resume"], timeout=150)
    assert again.returncode == 0, again.output[-3000:]
    records = _records(metrics)
    assert [r["iter"] for r in records] == [0, 1, 2, 3, 2, 3, 4], [r["iter"] for r in records]
    (resumed,) = events_of(records, ResumedEvent)
    assert resumed.iteration == 2 and resumed.checkpoint_found and records[4]["events"][-1] == resumed.to_dict()
