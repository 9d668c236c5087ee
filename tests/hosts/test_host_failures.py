"""Whole hosts failing under `ds-recycle launch`: a host lost, a host cut off, node 0 lost (tests/nethosts.py).

Layouts (DeepSpeed's rank order: rank = stage x pipelines + pipeline, two workers a host): with 2 stages x 3
pipelines on 3 hosts, host 0 holds (0, 0) and (1, 0), host 1 holds (2, 0) and (0, 1), host 2 holds (1, 1) and
(2, 1), so every stage keeps a replica whichever host is lost and the job goes on. With 2 stages x 2 pipelines
on 2 hosts, host 1 holds the whole of stage 1: its loss leaves the job to its checkpoint.
"""
from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch

from ds_recycle.events import HostBackEvent, HostLostEvent, HostPartitionedEvent, RejoinEvent, ResumedEvent
from tests.harness import assert_same_model
from tests.hosts.cluster import PORT, HostJob
from tests.hosts.conftest import REJOIN_STEPS, SHORT_STEPS
from tests.nethosts import NetHosts

pytestmark = pytest.mark.multiprocess

NODE_TIMEOUT_S = 6.0
#: the fence comes half a node timeout after the link went silent; the rest is polling and process exit
FENCE_BOUND_S = NODE_TIMEOUT_S / 2 + 3.0


def _workers(hosts: NetHosts, k: int) -> list[int]:
    """Training processes (not launchers, not sshd, not the fork server) of host ``k``: a worker forked by the
    launcher's fork server is named ``ds-rank-<R>``, a fresh one runs ``train.py``."""
    found = []
    for pid in hosts.pids(k):
        try:
            proc = psutil.Process(pid)
            name, cmd = proc.name(), " ".join(proc.cmdline())
        except psutil.Error:
            continue
        fresh = "train.py" in cmd and "ds_recycle launch" not in cmd and "ds-recycle launch" not in cmd
        if name.startswith("ds-rank-") or fresh:
            found.append(pid)
    return found


def _wait_until(what: str, check: Callable[[], bool], timeout_s: float) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.1)
    return time.monotonic() - start


def _rejoined_ranks(job: HostJob) -> set[int]:
    return {r for e in job.events(RejoinEvent) for r in e.ranks}


@pytest.mark.timeout(420)
def test_partition_fences_the_cut_host_the_rest_go_on_and_it_rejoins(
        nethosts: Callable[[int], NetHosts], tmp_path: Path, reference_2x3_rejoin: tuple[Path, Path]) -> None:
    config, reference = reference_2x3_rejoin
    hosts = nethosts(3)
    job = HostJob(hosts, tmp_path, config, REJOIN_STEPS, slots=2, worker_hosts=[0, 1, 2],
                  node_timeout_s=NODE_TIMEOUT_S)
    job.start_ssh()
    job.wait_iteration(5, 240)
    assert len(_workers(hosts, 2)) == 2
    hosts.cut(2)
    fenced_after = _wait_until("host 2's workers fenced", lambda: not _workers(hosts, 2), FENCE_BOUND_S)
    at = job.metrics()[-1]["iter"]
    job.wait_iteration(at + 5, 60)  # the others go on while host 2 is cut off
    lost = job.wait_event(HostLostEvent, 30)[0]
    assert lost.node == 2 and sorted(lost.ranks) == [4, 5]
    assert len(_workers(hosts, 2)) == 0  # still nothing trains there
    hosts.heal(2)
    job.wait_event(HostBackEvent, 60)
    codes = job.finish(300)
    assert codes == {"node0": 0}, job.logs()
    partitioned = job.events(HostPartitionedEvent)
    assert len(partitioned) == 1 and partitioned[0].node == 2, partitioned
    assert {4, 5} <= _rejoined_ranks(job), job.logs()
    assert job.metrics()[-1]["live_workers"] == 6
    print(f"fenced {fenced_after:.1f} s after the cut")
    assert_same_model(job.final_path, reference)


@pytest.mark.timeout(420)
def test_store_service_outlives_node0s_host_which_rejoins(
        nethosts: Callable[[int], NetHosts], tmp_path: Path, reference_2x3_rejoin: tuple[Path, Path]) -> None:
    """The store runs as `ds-recycle store` on a fourth host with no worker; node 0's whole host is SIGKILLed
    (its launcher and workers): the job goes on, node 0's launcher is started again and its ranks rejoin."""
    config, reference = reference_2x3_rejoin
    hosts = nethosts(4)
    job = HostJob(hosts, tmp_path, config, REJOIN_STEPS, slots=2, worker_hosts=[0, 1, 2],
                  node_timeout_s=NODE_TIMEOUT_S, store_host=3)
    job.start_store()
    job.start_all_no_ssh()
    job.wait_iteration(5, 240)
    hosts.kill_host(0)
    hosts.revive(0)
    job.start_node(0)  # waits for the node watch to declare node 0 lost, then restarts its ranks
    _wait_until("node 0's ranks rejoined", lambda: {0, 1} <= _rejoined_ranks(job), 180)
    codes = job.finish(300)
    assert codes == {"store": 0, "node0": 0, "node1": 0, "node2": 0}, job.logs()
    without = [r["iter"] for r in job.metrics() if r["live_workers"] == 4]
    assert without, job.logs()  # it went on without node 0 (stage 0 kept pipeline 2's worker) until they rejoined
    assert [e.node for e in job.events(HostLostEvent)] == [0]
    assert [e.after for e in job.events(HostBackEvent)] == ["host restart"]
    assert_same_model(job.final_path, reference)


@pytest.mark.timeout(420)
def test_host_loss_of_a_whole_stage_falls_back_to_the_checkpoint(
        nethosts: Callable[[int], NetHosts], tmp_path: Path, reference_2x2: tuple[Path, Path]) -> None:
    """2 x 2 on 2 hosts over ssh: losing host 1 loses stage 1; node 0's ranks leave as lost and are restarted;
    once host 1 is up again, `ds-recycle restart 2 3` makes node 0 start host 1's launcher again over ssh, and the
    job resumes from its checkpoint: the model is the one-host run's."""
    config, reference = reference_2x2
    hosts = nethosts(2)
    job = HostJob(hosts, tmp_path, config, SHORT_STEPS, slots=2, worker_hosts=[0, 1],
                  node_timeout_s=NODE_TIMEOUT_S, launcher_args=["--restart_failed_after", "1"],
                  train_args=["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-interval", "4", "--resume"])
    job.start_ssh()
    job.wait_iteration(5, 240)
    hosts.kill_host(1)
    # the survivors record the fallback and leave as lost (exit 75); the reporter was on host 1, so the event
    # is in node 0's log, not in the metrics file
    _wait_until("node 0's ranks fell back", lambda: '"kind": "fallback"' in job.text("node0")
                and job.text("node0").count("lost: exit code 75") >= 2, 60)
    hosts.revive(1)
    restart = hosts.run(0, [sys.executable, "-m", "ds_recycle", "restart", "--master_addr", hosts.addrs[0],
                            "--master_port", str(PORT), "--timeout", "60", "2", "3"], env=job.env)
    out, _ = restart.communicate(timeout=90)
    assert restart.returncode == 0 and "node 1's launcher started again over ssh" in out, out
    codes = job.finish(300)
    assert codes == {"node0": 0}, job.logs()
    assert job.events(ResumedEvent), job.logs()
    assert job.metrics()[-1]["iter"] == SHORT_STEPS - 1
    assert_same_model(job.final_path, reference)


@pytest.mark.timeout(300)
def test_sigkill_of_node0s_launcher_ends_the_job_cleanly_with_a_whole_checkpoint(
        nethosts: Callable[[int], NetHosts], tmp_path: Path, reference_2x2: tuple[Path, Path]) -> None:
    """Node 0's launcher hosts the store (the default): when it is SIGKILLed the job cannot go on. Every process
    of the job ends within a bounded time on both hosts, and the latest checkpoint is complete."""
    config, _ = reference_2x2
    hosts = nethosts(2)
    ckpt = tmp_path / "ckpt"
    job = HostJob(hosts, tmp_path, config, 100_000, slots=2, worker_hosts=[0, 1], node_timeout_s=NODE_TIMEOUT_S,
                  train_args=["--checkpoint-dir", str(ckpt), "--checkpoint-interval", "2"])
    job.start_ssh()
    job.wait_iteration(9, 240)
    job.procs["node0"].send_signal(signal.SIGKILL)  # `ip netns exec` execs: this is the launcher itself
    ended = _wait_until("every process of the job ended",
                        lambda: not _workers(hosts, 0) and not _workers(hosts, 1) and len(hosts.pids(1)) == 1, 60)
    latest = (ckpt / "latest").read_text().strip()
    stages = sorted(p.name for p in (ckpt / latest).iterdir())
    assert stages == ["stage0.pt", "stage1.pt"], stages
    for name in stages:
        torch.load(ckpt / latest / name, weights_only=False)  # loadable: nothing half-written
    print(f"every process ended {ended:.1f} s after the SIGKILL; latest checkpoint {latest}")
