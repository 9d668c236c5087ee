"""Multi-process tests of ``ds-recycle launch``: real launcher, real workers, real signals (gloo on CPU).

Each test starts the launcher as a child process (see conftest.py), bounds every wait, and checks that no
process outlives the test. Run:  PYTHONPATH=$PWD python -m pytest tests/launcher -q
"""
from __future__ import annotations

import os
import re
import signal
import time
from datetime import timedelta

import psutil
import pytest
from torch.distributed import TCPStore

from tests.launcher.launch_harness import WORKER, LaunchedJob, assert_no_survivors

pytestmark = pytest.mark.multiprocess  # starts launchers and gloo workers; run sequentially


_STORE_LINE = r"store at ([\d.]+):(\d+)"


def _store_of(job: LaunchedJob) -> TCPStore:
    host, port = job.wait_for(_STORE_LINE)[0].groups()
    return TCPStore(host, int(port), None, False, timedelta(seconds=10))


@pytest.mark.timeout(90)
def test_four_workers_finish_and_the_job_succeeds(launch) -> None:
    job = launch("--num_accelerators", "4", "--master_port", "0", WORKER, "--steps", "5")
    assert job.finish() == 0, job.text
    sums = {int(m[1]): int(m[2]) for m in job.wait_for(r"^\[rank (\d)\] DONE rank=\1 sum=(\d+)", 4)}
    assert sums == {r: 5 * (1 + 2 + 3 + 4) for r in range(4)}  # 5 all-reduces of rank+1 over 4 ranks
    ready = job.wait_for(r"READY rank=(\d) pid=\d+ world=4 local_rank_arg=(\d) restart=0 omp=1", 4)
    assert sorted((m[1], m[2]) for m in ready) == [(str(r), str(r)) for r in range(4)]
    port = int(job.wait_for(_STORE_LINE)[0][2])
    assert port != 29500 and port > 0  # --master_port 0 picked a free port
    assert "job succeeded with status 0: 4 rank(s) finished, 0 lost, 0 failed" in job.text
    assert_no_survivors(job)


@pytest.mark.timeout(90)
def test_killed_worker_is_reported_and_survivors_keep_running(launch) -> None:
    job = launch("--num_accelerators", "4", "--master_port", "0", WORKER, "--local_only",
                 "--steps", "80", "--step_sleep", "0.1")  # 8 s: the survivors are still running when checked
    pids = job.ready_pids(4)
    store = _store_of(job)
    os.kill(pids[2], signal.SIGKILL)
    store.wait(["ds_recycle/exit/2"], timedelta(seconds=10))
    assert store.get("ds_recycle/exit/2") == b"-9"
    # the exit's keys are written first, then it is counted (publish_exit_count): the count follows shortly
    deadline = time.monotonic() + 10.0
    while store.add("ds_recycle/exits", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.add("ds_recycle/exits", 0) == 1
    job.wait_for(r"rank 2 \(pid %d\) lost: signal SIGKILL" % pids[2])
    time.sleep(0.5)
    assert job.proc.poll() is None, "the launcher exited after one worker died"
    for rank in (0, 1, 3):
        assert psutil.Process(pids[rank]).status() != psutil.STATUS_ZOMBIE, f"rank {rank} was stopped"
    assert job.finish() == 0, job.text
    for rank in (0, 1, 3):
        assert re.search(r"rank %d \(pid %d\) finished: exit code 0 " % (rank, pids[rank]), job.text)
    assert "3 rank(s) finished, 1 lost, 0 failed" in job.text
    assert "SIGTERM" not in job.text
    assert_no_survivors(job)


@pytest.mark.timeout(90)
def test_death_inside_a_collective_lets_survivors_exit_by_themselves(launch) -> None:
    job = launch("--num_accelerators", "4", "--master_port", "0", "--log_ranks", "0,1,3", WORKER,
                 "--steps", "200", "--step_sleep", "0.01", "--die_rank", "2", "--die_step", "5", "--timeout", "5")
    assert job.finish() == 0, job.text
    failed = job.wait_for(r"^\[rank (\d)\] PEER_FAILED", 3)
    assert sorted(m[1] for m in failed) == ["0", "1", "3"]
    assert not re.search(r"^\[rank 2\]", job.text, re.M)  # --log_ranks left rank 2's stdout out
    assert re.search(r"rank 2 \(pid \d+\) lost: signal SIGKILL", job.text)
    assert "3 rank(s) finished, 1 lost, 0 failed" in job.text
    assert_no_survivors(job)


@pytest.mark.timeout(90)
def test_error_exit_fails_the_job_and_stops_the_rest_after_the_grace(launch) -> None:
    job = launch("--num_accelerators", "3", "--master_port", "0", "--error_grace", "1", "--kill_grace", "2",
                 WORKER, "--local_only", "--steps", "1000", "--step_sleep", "0.1",
                 "--die_rank", "1", "--die_step", "2", "--die_how", "exit1")
    started = time.monotonic()
    assert job.finish() == 1, job.text
    assert time.monotonic() - started < 30  # the 100 s of steps were cut short
    assert re.search(r"rank 1 \(pid \d+\) error: exit code 1 ", job.text)
    for rank in (0, 2):
        assert re.search(r"rank %d \(pid \d+\) lost: signal SIGTERM \(stopped by the launcher\)" % rank, job.text)
    assert "job failed with status 1" in job.text
    assert_no_survivors(job)


@pytest.mark.timeout(90)
def test_strict_stops_everyone_on_the_first_death(launch) -> None:
    job = launch("--num_accelerators", "3", "--master_port", "0", "--strict", WORKER, "--local_only",
                 "--steps", "1000", "--step_sleep", "0.1", "--die_rank", "0", "--die_step", "2")
    assert job.finish() == 1, job.text
    assert re.search(r"stopping the job: --strict: rank 0 signal SIGKILL", job.text)
    stopped = re.findall(r"summary: rank (\d) \(pid \d+\) lost: signal SIGTERM \(stopped by the launcher\)", job.text)
    assert sorted(stopped) == ["1", "2"]
    assert_no_survivors(job)


@pytest.mark.timeout(90)
def test_sigterm_to_the_launcher_is_forwarded_and_nothing_survives(launch) -> None:
    job = launch("--num_accelerators", "2", "--master_port", "0", "--kill_grace", "2", WORKER, "--local_only",
                 "--steps", "1000", "--step_sleep", "0.1", "--hang_rank", "1")
    job.ready_pids(2)
    job.proc.send_signal(signal.SIGTERM)
    assert job.finish() == 128 + signal.SIGTERM, job.text
    assert "stopping the job: the launcher received SIGTERM" in job.text
    assert_no_survivors(job)


@pytest.mark.timeout(90)
def test_sigkilled_launcher_takes_its_workers_along(launch) -> None:
    job = launch("--num_accelerators", "2", "--master_port", "0", WORKER, "--local_only",
                 "--steps", "1000", "--step_sleep", "0.1")
    pids = job.ready_pids(2)
    job.proc.kill()
    job.finish()
    deadline = time.monotonic() + 5
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids.values()):
        assert time.monotonic() < deadline, "workers outlived their SIGKILLed launcher"
        time.sleep(0.05)
    assert_no_survivors(job)


@pytest.mark.timeout(90)
def test_lost_rank_is_restarted_with_the_same_rank(launch) -> None:
    job = launch("--num_accelerators", "2", "--master_port", "0", "--restart_failed_after", "0.2", WORKER,
                 "--local_only", "--steps", "40", "--step_sleep", "0.1", "--die_rank", "1", "--die_how", "exit75")
    store = _store_of(job)
    job.wait_for(r"READY rank=1 pid=\d+ restart=1")
    assert store.get("ds_recycle/restarted/1") == b"1"
    assert store.add("ds_recycle/exits", 0) == 1
    assert not store.check(["ds_recycle/exit/1"])  # the restarted rank is alive again
    assert job.finish() == 0, job.text
    assert re.search(r"rank 1 \(pid \d+\) lost: exit code 75 ", job.text)
    assert re.search(r"rank 1 \(pid \d+, restart 1\) finished: exit code 0 ", job.text)
    assert "2 rank(s) finished, 0 lost, 0 failed" in job.text
    assert_no_survivors(job)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("how", "lost"), [("ecc", True), ("device-assert", False)])
def test_a_sticky_gpu_error_leaves_as_lost_and_comes_back_a_device_assert_fails_the_job(launch, how: str,
                                                                                         lost: bool) -> None:
    """An uncorrectable ECC error is the GPU's fault: the worker leaves as lost (75) and its restart finishes. A
    device-side assert is the program's: an error, which fails the job."""
    job = launch("--num_accelerators", "2", "--master_port", "0", "--restart_failed_after", "0.2",
                 "--error_grace", "0", WORKER, "--local_only", "--steps", "20", "--step_sleep", "0.1",
                 "--die_rank", "1", "--die_how", how)
    code = job.finish()
    if lost:
        assert code == 0, job.text
        assert "sticky CUDA error (uncorrectable ECC error encountered)" in job.text, job.text
        assert re.search(r"rank 1 \(pid \d+\) lost: exit code 75 ", job.text), job.text
        assert re.search(r"rank 1 \(pid \d+, restart 1\) finished: exit code 0 ", job.text), job.text
    else:
        assert code != 0 and "device-side assert triggered" in job.text and "sticky" not in job.text, job.text
    assert_no_survivors(job)


@pytest.mark.timeout(120)
def test_deepspeed_init_distributed_works_under_the_launcher(launch) -> None:
    job = launch("--num_gpus", "2", "--master_port", "0", WORKER, "--deepspeed", "--steps", "3")
    assert job.finish(100) == 0, job.text
    sums = sorted(m[2] for m in job.wait_for(r"^\[rank (\d)\] DONE rank=\1 sum=(\d+)", 2))
    assert sums == ["9", "9"]  # 3 all-reduces of 1 + 2
    assert_no_survivors(job)
