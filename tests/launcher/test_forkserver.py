"""Workers forked from the launcher's fork server: same program, environment, output, exit codes and signals as a
fresh process, started without importing torch again."""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from ds_recycle.launcher.forkserver import BOOTSTRAP, ForkServer, process_name
from ds_recycle.tools.procs import stat_name, worker_pids
from tests.launcher.launch_harness import launched_jobs

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = """
import gc, os, sys, time
log = open(os.environ.get("LOG", os.devnull), "w")  # never closed: its buffer must reach the file all the same
log.write("unclosed")
print("READY", os.environ["RANK"], os.getpid(), "torch" in sys.modules, gc.get_freeze_count() > 0,
      " ".join(sys.argv[1:]), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if "--sleep" in sys.argv:
    time.sleep(60)
sys.exit(int(os.environ["EXIT_WITH"]))
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is Linux only")


def _read_all(fd: int, until: bytes, timeout_s: float = 30.0) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout_s
    while until not in out and time.monotonic() < deadline:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        out += chunk
    return out


def test_a_forked_worker_runs_the_bootstrap_with_its_own_environment_output_and_exit_code(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "RANK": "5", "EXIT_WITH": "3", "LOG": str(tmp_path / "log")}
    server = ForkServer(env, preload=("torch",))
    try:
        argv = [sys.executable, "-u", "-m", BOOTSTRAP, str(script), "--flag", "x"]
        assert server.serves(argv) and not server.serves([sys.executable, str(script)])
        read_fd, write_fd = os.pipe()
        proc = server.spawn(argv, env, write_fd, write_fd)
        os.close(write_fd)
        assert proc is not None
        out = _read_all(read_fd, b"to stderr").decode()
        # torch came with the fork, and the server's objects are frozen (a worker's collections leave them alone)
        assert f"READY 5 {proc.pid} True True --flag x" in out and "to stderr" in out, out
        assert Path(f"/proc/{proc.pid}/comm").read_text().strip() == process_name(5)
        assert proc.wait(30) == 3 and proc.poll() == 3
        assert (tmp_path / "log").read_text() == "unclosed"
        os.close(read_fd)

        read_fd, write_fd = os.pipe()
        env6 = {**env, "RANK": "6", "EXIT_WITH": "0", "LOG": str(tmp_path / "log6")}
        sleeper = server.spawn([*argv, "--sleep"], env6, write_fd, write_fd)
        os.close(write_fd)
        assert sleeper is not None
        _read_all(read_fd, b"READY 6")
        assert os.getpgid(sleeper.pid) == sleeper.pid  # its own session and group: the launcher signals the group
        os.killpg(sleeper.pid, signal.SIGKILL)
        assert sleeper.wait(30) == -signal.SIGKILL
        os.close(read_fd)
    finally:
        server.close()


def test_a_workers_name_gives_its_rank_when_its_environ_file_cannot() -> None:
    assert stat_name("4242 (ds-rank-3) S 17 4242 4242 0 -1") == "ds-rank-3"
    assert stat_name("7 (python3 (x) y) S 1 7") == "python3 (x) y"


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("preload", ["auto", "off"])
def test_the_launcher_forks_its_workers_unless_told_not_to_and_restarts_them_the_same_way(tmp_path: Path,
                                                                                          preload: str) -> None:
    """Both ways, the workers run, are found by rank through /proc, a killed one is restarted as the same rank, and
    nothing survives the launcher's SIGKILL."""
    script = tmp_path / "worker.py"
    script.write_text(_SCRIPT)
    with launched_jobs() as start:
        job = start("--num_accelerators", "2", "--master_port", "0", "--preload", preload, "--no_local_rank",
                    "--restart_failed_after", "0.2", "--max_restarts", "1", str(script), "--sleep",
                    env={"EXIT_WITH": "0"})
        first = job.wait_for(r"READY (\d) (\d+) (True|False)", count=2, timeout_s=60)
        assert {m[3] for m in first} == ({"True"} if preload == "auto" else {"False"}), job.text
        pids = {int(m[1]): int(m[2]) for m in first}
        deadline = time.monotonic() + 20
        while worker_pids(job.proc.pid) != pids and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker_pids(job.proc.pid) == pids
        os.kill(pids[1], signal.SIGKILL)
        again = job.wait_for(r"READY 1 (\d+) (True|False)", count=2, timeout_s=60)[1]
        assert int(again[1]) != pids[1] and again[2] == first[0][3]
    # (leaving the block SIGKILLs the launcher: nothing it started, fork server and workers included, may outlive it)
