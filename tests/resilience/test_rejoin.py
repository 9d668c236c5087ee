"""A killed worker restarted by the launcher joins the running job; the model stays the failure-free one.

Pure parts (tickets, request decisions, the redo point, restart detection) run on a ``HashStore``; the
jobs run under ``ds-recycle launch --restart_failed_after`` with ``--kill`` (SIGKILL), and their final
parameters are compared with ``ds-recycle compare`` against a failure-free run.
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from ds_recycle.events import Event, FailureEvent, RejoinEvent, events_of  # noqa: E402
from ds_recycle.resilience.rejoin import JoinTicket, decide_requests, file_request, write_tickets  # noqa: E402
from ds_recycle.resilience.store import StoreKeys  # noqa: E402
from ds_recycle.resilience.watchdog import Watchdog  # noqa: E402
from tests.harness import assert_same_model, launch, tiny_config  # noqa: E402

# ------------------------------------------------------------------------------------------------ pure parts


def test_ticket_round_trips_through_json() -> None:
    t = JoinTicket(3, 2, (0, 1, 2, 3), 41, 3, (1,), 2, True, "")
    assert JoinTicket.from_json(t.to_json()) == t


def test_requests_decided_alike_latest_request_of_a_rank_wins() -> None:
    store, keys = dist.HashStore(), StoreKeys()
    for rank in (1, 2, 1, 0, 9):  # rank 1 filed twice (it died again), 0 is a member, 9 runs no worker
        file_request(store, keys, rank)
    accepted = decide_requests(store, keys, upto=5, after=0, members=[0, 3], job_ranks=[0, 1, 2, 3])
    assert accepted == {2: 2, 3: 1}
    write_tickets(store, keys, 5, 0, accepted, epoch=1, members=[0, 1, 2, 3], iteration=7, reporter=2)
    tickets = [JoinTicket.from_json(store.get(keys.join_ticket(n))) for n in range(1, 6)]
    assert [t.accepted for t in tickets] == [False, True, True, False, False]
    assert all(t.iteration == 7 and t.joining == (1, 2) and t.admitted_upto == 5 for t in tickets)
    assert decide_requests(store, keys, upto=5, after=5, members=[0], job_ranks=[0, 1]) == {}


def test_watchdog_sees_a_member_restarted_after_its_exit_key_was_deleted() -> None:
    """Right after a watch is armed (before its threads looked), the training thread's own look finds the death."""
    store, keys = dist.HashStore(), StoreKeys()
    dog = Watchdog(lambda: store, 0, 5.0, keys=keys, caller_store=store)  # threads not started
    dog.arm([0, 1], {0: 0, 1: 0})
    assert not dog.failed()
    store.add(keys.exits, 1)  # rank 1 died ...
    store.set(keys.restarted(1), "1")  # ... and the launcher restarted it (its exit key is gone again)
    assert dog.failed() and dog.declared is not None and dog.declared.rank == 1
    dog.arm([0, 1], {0: 0, 1: 1})
    assert not dog.failed()  # a new epoch counts the restarted process as a member


# ------------------------------------------------------------------------------------------------ jobs
RESTART = ["--restart_failed_after", "1", "--max_restarts", "1"]
E = TypeVar("E", bound=Event)


def _run(tmp: Path, name: str, steps: int, kills: list[str], launcher_args: list[str]) -> tuple[Path, str, list]:
    config = tiny_config(tmp, "c", 2, 2, failure_timeout_s=60.0)
    out, metrics = tmp / f"{name}.pt", tmp / f"{name}.jsonl"
    args = ["--deepspeed_config", str(config), "--steps", str(steps), "--save-final", str(out), "--metrics",
            str(metrics)]
    for k in kills:
        args += ["--kill", k]
    job = launch(4, args, timeout=240, launcher_args=launcher_args)
    assert job.returncode == 0, job.output[-5000:]
    return out, job.output, job.metrics(metrics)


def _events(records: list[dict], kind: type[E]) -> list[tuple[int, E]]:
    return [(r["iter"], e) for r in records for e in events_of([r], kind)]


STEPS = 100
"""Enough iterations left after the kill for the members to admit a restarted worker: they are paused while it
starts up (``LaunchedJob.members_paused``), so they cannot run past it however slowly it starts."""


@pytest.fixture(scope="module")
def baseline(reference: Callable[[int, int, int], Path]) -> Path:
    return reference(2, 2, STEPS)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_killed_worker_rejoins_then_its_peer_dies_same_model(tmp_path: Path, baseline: Path) -> None:
    """(1, 0) dies at iteration 2 and rejoins with state from (0, 0); a few iterations after the join (0, 0) is
    SIGKILLed from outside and the rejoined worker carries stage 0 alone: the model is the failure-free one.
    (The second kill waits for the join: a fixed iteration would race the restarted process's start-up.) A checkpoint
    every iteration: the joiner's loop, catching up, skips the ones the members wrote before letting it in."""
    from tests.launcher.launch_harness import LaunchedJob

    config = tiny_config(tmp_path, "c", 2, 2, failure_timeout_s=60.0)
    out, metrics = tmp_path / "k.pt", tmp_path / "k.jsonl"
    job = LaunchedJob(["--num_accelerators", "4", "--master_port", "0", *RESTART, str(REPO / "launch" / "train.py"),
                       "--deepspeed_config", str(config), "--steps", str(STEPS), "--save-final", str(out),
                       "--metrics", str(metrics), "--kill", "1:0@2:backward-input", "--checkpoint-dir",
                       str(tmp_path / "ck"), "--checkpoint-interval", "1"], env={"WANDB_MODE": "disabled"})
    try:
        with job.members_paused(1, 1, [0, 2, 3]):
            pass
        joined = int(job.wait_for(r"joined the running job at iteration (\d+)", timeout_s=200)[0][1])
        while not metrics.exists() or len(metrics.read_text().splitlines()) < joined + 3:
            assert job.proc.poll() is None, job.text[-4000:]
            time.sleep(0.05)
        job.signal_ranks([0], signal.SIGKILL)
        assert job.proc.wait(timeout=200) == 0, job.text[-4000:]
    finally:
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)
    output, records = job.text, [json.loads(line) for line in metrics.read_text().splitlines()]
    (joined_at, join), *later = _events(records, RejoinEvent)  # later: the killed (0, 0), restarted, may join too
    assert all(j.ranks == (0,) and j.workers == ((0, 0),) for _, j in later), later
    assert join.ranks == (1,) and join.workers == ((1, 0),) and 2 < joined_at == joined, join
    assert join.members == (0, 1, 2, 3)
    by_iter = {r["iter"]: r for r in records}
    assert by_iter[joined_at - 1]["live_workers"] == 3 and by_iter[joined_at - 1]["rerouted_microbatches"] > 0
    assert by_iter[joined_at]["live_workers"] == 4 and by_iter[joined_at]["rerouted_microbatches"] == 0
    failures = _events(records, FailureEvent)
    assert [e.lost_workers for _, e in failures] == [((1, 0),), ((0, 0),)], failures
    assert records[-1]["live_workers"] == 3 + len(later) and len(records) == STEPS
    assert re.search(r"summary: rank 1 \(pid \d+, restart 1\) finished: exit code 0", output), output[-3000:]
    assert_same_model(out, baseline)


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_worker_restarted_after_training_ended_leaves_without_joining(tmp_path: Path) -> None:
    _, output, records = _run(tmp_path, "late", 6, ["1:0@4:forward"], RESTART)
    assert "not joining: training ended" in output, output[-4000:]
    assert re.search(r"summary: rank 1 \(pid \d+, restart 1\) finished: exit code 0", output), output[-3000:]
    assert len(records) == 6 and not _events(records, RejoinEvent)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_worker_restarted_on_command_rejoins_same_model(tmp_path: Path, baseline: Path) -> None:
    """No --restart_failed_after: the killed rank stays down until `ds-recycle restart` brings it back."""
    from ds_recycle.cli import main as ds_recycle
    from tests.launcher.launch_harness import LaunchedJob

    config = tiny_config(tmp_path, "c", 2, 2, failure_timeout_s=60.0)
    out, metrics = tmp_path / "cmd.pt", tmp_path / "cmd.jsonl"
    job = LaunchedJob(["--num_accelerators", "4", "--master_port", "0", str(REPO / "launch" / "train.py"),
                       "--deepspeed_config", str(config), "--steps", str(STEPS), "--save-final", str(out),
                       "--metrics", str(metrics), "--kill", "1:0@2:forward"], env={"WANDB_MODE": "disabled"})
    try:
        port = int(job.wait_for(r"store at [\d.]+:(\d+)")[0][1])
        job.wait_for(r"rank 1 \(pid \d+\) lost: signal SIGKILL", timeout_s=120)
        assert ds_recycle(["restart", "--master_port", str(port), "--timeout", "60", "1"]) == 0
        with job.members_paused(1, 1, [0, 2, 3]):
            pass
        assert job.proc.wait(timeout=200) == 0, job.text[-4000:]
    finally:
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)
    assert "joined the running job at iteration" in job.text, job.text[-4000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    (_, join), = _events(records, RejoinEvent)
    assert join.workers == ((1, 0),) and records[-1]["live_workers"] == 4
    assert_same_model(out, baseline)
