"""A harness that runs ``python -m ds_recycle launch`` as a real child process and watches its output.

Every launcher started through :func:`launched_jobs` is killed at the end if still running, and the test
fails if any process it ever had as a descendant outlives it.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).with_name("allreduce_worker.py"))


class LaunchedJob:
    """One launcher process; its stdout and stderr are merged and collected line by line."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        full_env = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO)}
        full_env.pop("OMP_NUM_THREADS", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "ds_recycle", "launch", *args], cwd=REPO, env=full_env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self.seen: dict[int, psutil.Process] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            with self._cond:
                self.lines.append(raw.decode(errors="replace").rstrip("\n"))
                self._cond.notify_all()
            self.snapshot()

    @property
    def text(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def snapshot(self) -> None:
        """Remember every current descendant of the launcher (to check later that none survives)."""
        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            pass

    def wait_for(self, pattern: str, count: int = 1, timeout_s: float = 60.0) -> list[re.Match[str]]:
        """Block until ``count`` output lines match ``pattern``; fail the test on timeout."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                matches = [m for m in map(regex.search, self.lines) if m]
                if len(matches) >= count:
                    return matches
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    pytest.fail(f"waited for {count} x {pattern!r}; output so far:\n" + "\n".join(self.lines))
                self._cond.wait(min(left, 0.2))

    def ready_pids(self, count: int) -> dict[int, int]:
        """``{rank: pid}`` from the workers' READY lines."""
        matches = self.wait_for(r"READY rank=(\d+) pid=(\d+)", count)
        self.snapshot()
        return {int(m[1]): int(m[2]) for m in matches}

    def pids(self) -> dict[int, int]:
        """``rank -> pid`` of the workers running now (found through ``/proc``)."""
        from ds_recycle.tools.procs import worker_pids

        return worker_pids(self.proc.pid)

    def signal_ranks(self, ranks: list[int], sig: signal.Signals) -> None:
        """Send ``sig`` to the workers of ``ranks`` (each must be running)."""
        pids = self.pids()
        for rank in ranks:
            assert rank in pids, (rank, pids)
            os.kill(pids[rank], sig)

    @contextlib.contextmanager
    def members_paused(self, rank: int, restart: int, members: list[int], timeout_s: float = 150.0) -> Iterator[None]:
        """Stop ``members`` (SIGSTOP) once the launcher has started restart ``restart`` of ``rank``; yield once that
        process has filed its join request; resume them on exit. The members cannot train past a restarted process
        while it starts up however loaded the machine is, so a job needs only a few iterations left to admit it."""
        self.wait_for(rf"restarted rank {rank} as pid \d+ \(restart {restart}\)", timeout_s=120)
        self.signal_ranks(members, signal.SIGSTOP)
        try:
            self.wait_for(rf"join request \d+ filed for rank {rank} \(restart {restart}\)", timeout_s=timeout_s)
            yield
        finally:
            self.signal_ranks(members, signal.SIGCONT)

    def finish(self, timeout_s: float = 60.0) -> int:
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher did not exit within {timeout_s} s; output:\n{self.text}")
        self._reader.join(5)
        return code

    def survivors(self) -> list[psutil.Process]:
        """Descendants ever seen that still run (zombies and recycled pids excluded)."""
        alive = []
        for proc in self.seen.values():
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except psutil.NoSuchProcess:
                pass
        return alive

    def wait_survivors_gone(self, grace_s: float = 3.0) -> list[psutil.Process]:
        """Descendants still running after up to ``grace_s`` seconds (a dying process needs a moment)."""
        deadline = time.monotonic() + grace_s
        while self.survivors() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.survivors()


def assert_no_survivors(job: LaunchedJob, grace_s: float = 3.0) -> None:
    left = job.wait_survivors_gone(grace_s)
    assert not left, f"processes left behind: {left}\n{job.text}"


@contextlib.contextmanager
def launched_jobs() -> Iterator[Callable[..., LaunchedJob]]:
    """Yield a ``start(*launcher_args, env=None)`` function; on exit, kill and check what it started."""
    jobs: list[LaunchedJob] = []

    def start(*args: str, env: dict[str, str] | None = None) -> LaunchedJob:
        job = LaunchedJob(list(args), env)
        jobs.append(job)
        return job

    try:
        yield start
    finally:
        _cleanup(jobs)


def _cleanup(jobs: list[LaunchedJob]) -> None:
    leftovers = []
    for job in jobs:
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)
            job.proc.wait(10)
        left = job.wait_survivors_gone()
        leftovers += left
        for proc in left:
            proc.kill()
    assert not leftovers, f"processes left behind: {leftovers}"
