"""A job of several hosts on a replicated etcd (`ds-recycle launch --store etcd://...`): one etcd member per host,
no process that the job cannot lose. Layout as in test_host_failures.py: 2 stages x 3 pipelines on 3 hosts, two
workers a host, every stage with a replica on two hosts.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ds_recycle.events import HostBackEvent, HostLostEvent, HostPartitionedEvent, RejoinEvent
from tests.etcd_cluster import ETCD, EtcdCluster
from tests.harness import assert_same_model
from tests.hosts.cluster import HostJob
from tests.hosts.conftest import REJOIN_STEPS, SHORT_STEPS, host_config
from tests.hosts.test_host_failures import FENCE_BOUND_S, NODE_TIMEOUT_S, _wait_until, _workers
from tests.nethosts import NetHosts

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(ETCD is None, reason="no etcd: `sudo bash launch/setup_hosts.sh` installs it")]


@pytest.fixture
def etcd_hosts(nethosts: Callable[[int], NetHosts], tmp_path: Path) -> Iterator[tuple[NetHosts, EtcdCluster]]:
    """Three hosts, each running one member of a 3-member etcd cluster."""
    hosts = nethosts(3)
    folder = tmp_path / "etcd"
    folder.mkdir()
    cluster = EtcdCluster(folder, hosts=hosts)
    try:
        yield hosts, cluster
    finally:
        cluster.close()


MEMBERS_PAUSED_S = 120.0
"""Longest the members stay stopped while a lost host boots again and its ranks file their join requests."""


def _job(hosts: NetHosts, cluster: EtcdCluster, folder: Path, config: Path, steps: int) -> HostJob:
    return HostJob(hosts, folder, config, steps, slots=2, worker_hosts=[0, 1, 2], node_timeout_s=NODE_TIMEOUT_S,
                   launcher_args=["--store", cluster.endpoints + "/hostjob"])


def _first_iteration_with(job: HostJob, live: int, after_iter: int, timeout_s: float) -> float:
    """Seconds until the metrics hold an iteration after ``after_iter`` trained by ``live`` workers."""
    return _wait_until(f"an iteration with {live} live workers",
                       lambda: any(r["iter"] > after_iter and r["live_workers"] == live for r in job.metrics()),
                       timeout_s)


def _rejoined(job: HostJob) -> set[int]:
    return {r for e in job.events(RejoinEvent) for r in e.ranks}


@pytest.mark.timeout(420)
def test_losing_node0s_host_with_the_etcd_leader_leaves_the_job_training_and_it_rejoins(
        etcd_hosts: tuple[NetHosts, EtcdCluster], tmp_path: Path, reference_2x3_rejoin: tuple[Path, Path]) -> None:
    """Host 0 runs node 0's launcher, two workers and the etcd leader; all of it is SIGKILLed at once. The other
    launchers declare node 0 lost (one of them), the workers re-route around it, the job trains on; host 0 boots
    again (its etcd member rejoins the cluster, node 0's launcher restarts its ranks) and the job ends at the
    failure-free model, every launcher reporting success.

    A booting host takes longer than the short job has left: the harness stops the members (SIGSTOP) while host 0
    comes back, until its restarted ranks have filed their join requests (heartbeat_stale_s is set above the
    pause), so they are admitted with iterations to spare however loaded the machine is."""
    hosts, cluster = etcd_hosts
    shared, reference = reference_2x3_rejoin
    config = tmp_path / "leader.json"
    data = json.loads(shared.read_text())
    data["recycle"]["heartbeat_stale_s"] = MEMBERS_PAUSED_S + 60.0
    config.write_text(json.dumps(data))
    job = _job(hosts, cluster, tmp_path, config, REJOIN_STEPS)
    job.start_all_no_ssh()
    job.wait_iteration(5, 240)
    cluster.move_leader(0)
    at = job.metrics()[-1]["iter"]
    hosts.kill_host(0)
    training = _first_iteration_with(job, 4, at, 120)
    lost = job.wait_event(HostLostEvent, 30)
    assert [e.node for e in lost] == [0] and sorted(lost[0].ranks) == [0, 1], job.logs()
    members = _workers(hosts, 1) + _workers(hosts, 2)
    assert len(members) == 4, members
    paused = time.monotonic()
    for pid in members:
        os.kill(pid, signal.SIGSTOP)
    try:
        hosts.revive(0)
        cluster.start(0)
        cluster.wait_healthy([0], 30)
        job.start_node(0)  # a returning node 0: joins the job in the namespace, restarts its ranks once declared lost
        _wait_until("node 0's restarted ranks filed their join requests",
                    lambda: len(re.findall(r"join request \d+ filed for rank [01] ", job.text("node0"))) >= 2,
                    MEMBERS_PAUSED_S)
        filed = time.monotonic() - paused
    finally:
        for pid in members:
            os.kill(pid, signal.SIGCONT)
    back = _wait_until("node 0's ranks rejoined", lambda: {0, 1} <= _rejoined(job), 120)
    codes = job.finish(300)
    assert codes == {"node0": 0, "node1": 0, "node2": 0}, job.logs()
    assert len(job.events(HostLostEvent)) == 1 and [e.after for e in job.events(HostBackEvent)] == ["host restart"]
    assert job.metrics()[-1]["live_workers"] == 6
    assert_same_model(job.final_path, reference)
    print(f"host 0 (node 0, etcd leader) SIGKILLed: first iteration on 4 workers {training:.1f} s later; host 0 "
          f"back and its ranks' join requests filed {filed:.1f} s after the members paused; rejoined {back:.1f} s after they resumed")


@pytest.mark.timeout(420)
def test_a_cut_off_host_fences_itself_the_rest_go_on_and_two_hosts_lost_end_the_job_cleanly(
        etcd_hosts: tuple[NetHosts, EtcdCluster], tmp_path: Path) -> None:
    """Host 2's link is cut: its etcd member is in the minority, its launcher fences its workers, the others
    declare it lost and train on; the link comes back and its ranks rejoin. Then hosts 1 and 2 are SIGKILLed
    together: the survivor has no etcd quorum, fences its workers and leaves; the checkpoint is whole."""
    hosts, cluster = etcd_hosts
    config = host_config(tmp_path, 3)  # the job never ends by itself: nothing to compare with
    ckpt = tmp_path / "ckpt"
    job = HostJob(hosts, tmp_path, config, 100_000, slots=2, worker_hosts=[0, 1, 2], node_timeout_s=NODE_TIMEOUT_S,
                  launcher_args=["--store", cluster.endpoints + "/hostjob", "--store_timeout", "20"],
                  train_args=["--checkpoint-dir", str(ckpt), "--checkpoint-interval", "4"])
    job.start_all_no_ssh()
    job.wait_iteration(5, 240)
    hosts.cut(2)
    cut_at = time.monotonic()
    fenced = _wait_until("host 2's workers fenced", lambda: not _workers(hosts, 2), FENCE_BOUND_S + 4)
    at = job.metrics()[-1]["iter"]
    _first_iteration_with(job, 4, at, 120)
    training = time.monotonic() - cut_at
    assert [e.node for e in job.wait_event(HostLostEvent, 30)] == [2]
    hosts.heal(2)
    back = _wait_until("host 2's ranks rejoined", lambda: {4, 5} <= _rejoined(job), 180)
    assert [e.node for e in job.events(HostPartitionedEvent)] == [2]
    at = job.metrics()[-1]["iter"]
    job.wait_iteration(at + 8, 120)  # a checkpoint written by all six again
    hosts.kill_host(1)
    hosts.kill_host(2)
    start = time.monotonic()
    code = job.wait("node0", 120)
    ended = time.monotonic() - start
    assert code != 0 and not _workers(hosts, 0), job.logs()
    latest = (ckpt / "latest").read_text().strip()
    assert sorted(p.name for p in (ckpt / latest).iterdir()) == ["stage0.pt", "stage1.pt"]
    print(f"host 2 cut: fenced in {fenced:.1f} s, first iteration on 4 workers {training:.1f} s after the cut, "
          f"rejoined {back:.1f} s after the heal; hosts 1 and 2 lost: node 0 left {ended:.1f} s later (exit {code})")


@pytest.mark.timeout(420)
def test_a_host_lost_during_the_start_up_starts_it_again_once_back(
        etcd_hosts: tuple[NetHosts, EtcdCluster], tmp_path: Path, reference_2x3_short: tuple[Path, Path]) -> None:
    """Host 2 (its launcher, workers and etcd member) is SIGKILLed while the workers start, before the first
    iteration. The watch's declaration restarts the start-up as generation 1; the others wait in it until host 2
    boots again and its launcher restarts its ranks; the job ends at the failure-free model (a short job: all of
    it runs after the loss)."""
    hosts, cluster = etcd_hosts
    config, reference = reference_2x3_short
    job = _job(hosts, cluster, tmp_path, config, SHORT_STEPS)
    job.start_all_no_ssh()
    _wait_until("host 2's workers started", lambda: len(_workers(hosts, 2)) == 2, 120)
    time.sleep(1.0)
    hosts.kill_host(2)
    assert not job.metrics(), "the first iteration ended before the kill: not a death during the start-up"
    _wait_until("the start-up restarted", lambda: any("(generation 1)" in job.text(f"node{k}") for k in (0, 1)), 60)
    hosts.revive(2)
    cluster.start(2)
    cluster.wait_healthy([2], 30)
    job.start_node(2)
    codes = job.finish(300)
    assert codes == {"node0": 0, "node1": 0, "node2": 0}, (codes, job.logs())
    assert job.metrics()[0]["live_workers"] == 6 and job.metrics()[-1]["iter"] == SHORT_STEPS - 1
    assert "(generation 2)" not in job.logs(100_000)  # one restart of the start-up for one loss
    assert_same_model(job.final_path, reference)
