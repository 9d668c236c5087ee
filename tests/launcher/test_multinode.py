"""Two launchers on one machine as two nodes: every multi-host path except ssh itself and a real network.

The hostfile names this machine twice (``localhost`` and ``127.0.0.1``), so node 0 and node 1 both run here.
With ``--no_ssh`` both launchers are started by the test; otherwise node 0 starts node 1 with its generated
ssh command line, run by a stand-in ``ssh`` on PATH that executes the remote command locally. Covered: a
node connecting to node 0's store, cross-node rendezvous, exits recorded by the node that owns the rank,
node 0 waiting for every rank and computing the job's status from the store, a stop spreading through
``ds_recycle/stop``, and a node stopping its workers when node 0 dies.
"""
from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import pytest

from tests.launcher.launch_harness import WORKER, assert_no_survivors

pytestmark = pytest.mark.multiprocess  # starts launchers and gloo workers; run sequentially



def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _two_nodes(tmp_path: Path) -> list[str]:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n127.0.0.1 slots=1\n")
    return ["--hostfile", str(hostfile), "--no_ssh", "--master_addr", "127.0.0.1", "--master_port",
            str(_free_port())]


@pytest.mark.timeout(120)
def test_two_nodes_rendezvous_and_node0_reports_every_rank(launch, tmp_path: Path) -> None:
    common = _two_nodes(tmp_path)
    node0 = launch(*common, WORKER, "--steps", "5")
    node0.wait_for(r"store at ")
    node1 = launch(*common, "--node_rank", "1", WORKER, "--steps", "5")
    assert node1.finish() == 0, node1.text
    assert node0.finish() == 0, node0.text
    assert re.search(r"^\[rank 2\] DONE rank=2 sum=30$", node1.text, re.M)  # 5 x (1 + 2 + 3)
    assert len(re.findall(r"^\[rank [01]\] DONE rank=[01] sum=30$", node0.text, re.M)) == 2
    assert "job succeeded with status 0: 3 rank(s) finished, 0 lost, 0 failed" in node0.text
    assert_no_survivors(node0)
    assert_no_survivors(node1)


@pytest.mark.timeout(120)
def test_error_on_node1_stops_node0_through_the_store(launch, tmp_path: Path) -> None:
    common = [*_two_nodes(tmp_path), "--error_grace", "0.5", "--kill_grace", "2"]
    args = [WORKER, "--local_only", "--steps", "1000", "--step_sleep", "0.1", "--die_rank", "2", "--die_step", "5",
            "--die_how", "exit1"]
    node0 = launch(*common, *args)
    node0.wait_for(r"store at ")
    node1 = launch(*common, "--node_rank", "1", *args)
    assert node1.finish() == 1, node1.text
    assert node0.finish() == 1, node0.text
    assert re.search(r"stopping the job: stop requested in the store: node 1: ", node0.text)
    stopped = re.findall(r"summary: rank ([01]) \(pid \d+\) lost: signal SIGTERM \(stopped by the launcher\)",
                         node0.text)
    assert sorted(stopped) == ["0", "1"]
    assert "job failed with status 1: 0 rank(s) finished, 2 lost, 1 failed" in node0.text
    assert_no_survivors(node0)
    assert_no_survivors(node1)


@pytest.mark.timeout(120)
def test_node1_stops_its_workers_when_node0_dies(launch, tmp_path: Path) -> None:
    common = _two_nodes(tmp_path)
    args = [WORKER, "--local_only", "--steps", "1000", "--step_sleep", "0.1"]
    node0 = launch(*common, *args)
    node0.ready_pids(2)
    node1 = launch(*common, "--node_rank", "1", *args)
    node1.wait_for(r"READY rank=2 ")
    node1.snapshot()
    node0.proc.kill()
    assert node1.finish(30) == 1, node1.text
    assert "stopping the job: lost the store of node 0" in node1.text
    assert re.search(r"rank 2 \(pid \d+\) lost: signal SIGTERM \(stopped by the launcher\)", node1.text)
    assert_no_survivors(node0)
    assert_no_survivors(node1)


_SSH_STAND_IN = """#!/bin/sh
# Stands in for ssh on one machine: ignore the options and the host, run the remote command (last argument) here.
for last; do :; done
exec /bin/sh -c "$last"
"""


@pytest.mark.timeout(120)
def test_node0_starts_node1_through_the_ssh_command(launch, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(_SSH_STAND_IN)
    (bin_dir / "ssh").chmod(0o755)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n127.0.0.1 slots=1\n")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    node0 = launch("--hostfile", str(hostfile), "--master_addr", socket.gethostname(), "--master_port", "0",
                   WORKER, "--steps", "5", env=env)
    assert node0.finish() == 0, node0.text
    assert re.search(r"started node 1 on 127\.0\.0\.1 as pid \d+", node0.text)
    assert re.search(r"^\[rank 2\] DONE rank=2 sum=30$", node0.text, re.M)  # forwarded from node 1's launcher
    assert re.search(r"\[ds-recycle launch node 1\] .* node 1 of 2 runs ranks \[2\] of 3", node0.text)
    assert re.search(r"node 1 on 127\.0\.0\.1 \(pid \d+\) finished: exit code 0", node0.text)
    assert "job succeeded with status 0: 3 rank(s) finished, 0 lost, 0 failed" in node0.text
    assert_no_survivors(node0)
