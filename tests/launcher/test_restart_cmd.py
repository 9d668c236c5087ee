"""``ds-recycle restart``: lost ranks restarted on command by a real launcher, and every refusal path of the CLI.

The launcher tests run ``ds-recycle launch`` as a child process with tiny workers (:mod:`restart_child`, no
torch) and call ``ds-recycle restart`` in this process through the real entry point (:func:`ds_recycle.cli.main`),
so its registration, argument parsing, output and exit status are what is tested. The CLI-only tests talk to a
bare store that this test hosts. Run:  PYTHONPATH=$PWD python -m pytest tests/launcher/test_restart_cmd.py -q
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from ds_recycle.cli import main as ds_recycle
from ds_recycle.launcher.restart_requests import RestartResult
from tests.launcher.launch_harness import REPO, LaunchedJob, assert_no_survivors

CHILD = str(Path(__file__).with_name("restart_child.py"))


def _port(job: LaunchedJob) -> int:
    return int(job.wait_for(r"store at [\d.]+:(\d+)")[0][1])


def _client(port: int) -> TCPStore:
    return TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))


def _restart(port: int, *ranks: int, timeout_s: float = 30.0) -> int:
    return ds_recycle(["restart", "--master_port", str(port), "--timeout", str(timeout_s), *map(str, ranks)])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_lost_rank_stays_down_until_restarted_on_command(launch, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    go = tmp_path / "go"
    job = launch("--num_accelerators", "2", "--master_port", "0", "--max_restarts", "1",
                 CHILD, "--die_rank", "1", "--until_file", str(go))
    pids = job.ready_pids(2)
    job.wait_for(r"rank 1 \(pid %d\) lost: signal SIGKILL" % pids[1])
    port = _port(job)
    store = _client(port)
    time.sleep(1.0)  # four store polls: without --restart_failed_after nothing restarts rank 1 by itself
    assert store.get("ds_recycle/exit/1") == b"-9"
    assert not store.check(["ds_recycle/restarted/1"])
    assert "restart=1" not in job.text

    assert _restart(port, 0) == 1  # rank 0 is running: refused
    assert f"rank 0: refused (running): rank 0 is running as pid {pids[0]};" in capsys.readouterr().err
    job.wait_for(r"refused the restart request \S+ for rank 0 \(running\)")

    assert _restart(port, 1) == 0
    out = capsys.readouterr().out
    new_pid = int(re.search(r"^rank 1: restarted as pid (\d+) \(restart 1 of at most 1\)$", out, re.M)[1])
    job.wait_for(r"READY rank=1 pid=%d restart=1$" % new_pid)  # DS_RECYCLE_RESTART_COUNT=1
    assert store.get("ds_recycle/restarted/1") == b"1"
    assert not store.check(["ds_recycle/exit/1"])  # the rank's process exists again
    assert not store.check(["ds_recycle/restart_request/1"])  # answered requests are deleted
    assert RestartResult.decode(store.get("ds_recycle/restart_result/1").decode()).pid == new_pid

    os.kill(new_pid, signal.SIGKILL)  # lost again: --max_restarts 1 is used up
    job.wait_for(r"rank 1 \(pid %d, restart 1\) lost: signal SIGKILL" % new_pid)
    assert _restart(port, 1) == 1
    assert "rank 1: refused (out of restarts): rank 1 was restarted 1 time(s) already" in capsys.readouterr().err

    go.touch()
    assert job.finish() == 0, job.text
    assert re.search(r"rank 1: restarted as pid %d \(restart 1 of at most 1\), on request " % new_pid, job.text)
    assert "job succeeded with status 0: 1 rank(s) finished, 1 lost, 0 failed" in job.text
    assert_no_survivors(job)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_finished_and_unknown_ranks_are_refused_and_the_job_ends_without_a_command(
        launch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    go = tmp_path / "go"
    job = launch("--num_accelerators", "3", "--master_port", "0", CHILD, "--die_rank", "1", "--finish_rank", "2",
                 "--until_file", str(go))
    job.wait_for(r"rank 1 \(pid \d+\) lost: signal SIGKILL")
    job.wait_for(r"rank 2 \(pid \d+\) finished: exit code 0")
    port = _port(job)

    assert _restart(port, 2) == 1
    assert "rank 2: refused (finished): rank 2 finished (exit code 0)" in capsys.readouterr().err
    assert _restart(port, 7) == 2
    assert "RANK [7]: the job at 127.0.0.1:%d has ranks 0..2" % port in capsys.readouterr().err

    go.touch()  # rank 1 is lost and could be restarted, but the job ends when its last worker ends
    assert job.finish() == 0, job.text
    assert "job succeeded with status 0: 2 rank(s) finished, 1 lost, 0 failed" in job.text
    assert "restart=1" not in job.text
    assert_no_survivors(job)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_the_launcher_of_another_node_restarts_its_own_rank(launch, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    go = tmp_path / "go"
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n127.0.0.1 slots=1\n")
    port = _free_port()
    common = ["--hostfile", str(hostfile), "--no_ssh", "--master_addr", "127.0.0.1", "--master_port", str(port)]
    args = [CHILD, "--die_rank", "2", "--until_file", str(go)]
    node0 = launch(*common, *args)
    node0.wait_for(r"store at ")
    node1 = launch(*common, "--node_rank", "1", *args)
    node1.wait_for(r"rank 2 \(pid \d+\) lost: signal SIGKILL")

    assert _restart(port, 2) == 0
    new_pid = int(re.search(r"^rank 2: restarted as pid (\d+) ", capsys.readouterr().out, re.M)[1])
    node1.wait_for(r"READY rank=2 pid=%d restart=1$" % new_pid)
    assert node1.wait_for(r"no worker of this node runs; rank\(s\) \[2\] can be restarted on command")

    os.kill(new_pid, signal.SIGKILL)  # lost again, and restartable: node 1 waits for a command ...
    node1.wait_for(r"rank 2 \(pid %d, restart 1\) lost: signal SIGKILL" % new_pid)
    time.sleep(1.0)
    assert node1.proc.poll() is None, node1.text
    go.touch()  # ... until the ranks of node 0 end, without one
    assert node1.finish() == 0, node1.text
    assert node0.finish() == 0, node0.text
    assert "job succeeded with status 0: 2 rank(s) finished, 1 lost, 0 failed" in node0.text
    assert_no_survivors(node0)
    assert_no_survivors(node1)


# ---- the CLI against a bare store (no launcher) ------------------------------------------------------------------
@pytest.fixture
def bare_store() -> Iterator[TCPStore]:
    """A store that this test hosts, with the world size a launcher of 2 ranks would write."""
    store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    store.set("ds_recycle/world_size", "2")
    yield store


@pytest.mark.timeout(60)
def test_nothing_listening_is_a_clear_error_from_the_real_command() -> None:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "ds_recycle", "restart", "--master_port", str(port), "0"], env=env,
                          capture_output=True, text=True, timeout=50)
    assert done.returncode == 2, done
    assert f"nothing answers at --master_addr 127.0.0.1 --master_port {port}" in done.stderr
    assert "store at ADDR:PORT" in done.stderr


def test_a_store_without_a_job_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    assert _restart(store.port, 0) == 2
    assert "holds no `ds-recycle launch` job (no ds_recycle/world_size key)" in capsys.readouterr().err


@pytest.mark.parametrize("ranks, message", [(["-1"], "RANK -1 is negative"), (["x"], "RANK 'x' is not an integer")])
def test_bad_ranks_are_rejected_by_the_parser(ranks: list[str], message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        ds_recycle(["restart", "--master_port", "1", *ranks])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_duplicate_rank_is_rejected(bare_store: TCPStore, capsys: pytest.CaptureFixture[str]) -> None:
    assert _restart(bare_store.port, 1, 1) == 2
    assert "RANK [1, 1]: a rank is given twice" in capsys.readouterr().err


def test_unanswered_request_times_out_and_is_withdrawn(bare_store: TCPStore,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    assert _restart(bare_store.port, 1, timeout_s=0.3) == 1
    assert time.monotonic() - started < 5
    assert "rank 1: not restarted: no answer for rank 1 within 0.3 s" in capsys.readouterr().err
    assert not bare_store.check(["ds_recycle/restart_request/1"])
    assert int(bare_store.add("ds_recycle/restart_requests", 0)) == 1


def test_a_pending_request_blocks_a_second_one(bare_store: TCPStore, capsys: pytest.CaptureFixture[str]) -> None:
    bare_store.set("ds_recycle/restart_request/0", "host:1:2")
    assert _restart(bare_store.port, 0, timeout_s=0.3) == 1
    assert "another restart request for rank 0 (host:1:2) is pending" in capsys.readouterr().err
    assert bare_store.get("ds_recycle/restart_request/0") == b"host:1:2"  # the other requester's key is kept


def test_a_stopping_job_restarts_nothing(bare_store: TCPStore, capsys: pytest.CaptureFixture[str]) -> None:
    bare_store.set("ds_recycle/stop", "node 0: the launcher received SIGTERM")
    assert _restart(bare_store.port, 0) == 1
    assert "is being stopped (node 0: the launcher received SIGTERM)" in capsys.readouterr().err
    assert not bare_store.check(["ds_recycle/restart_request/0"])
