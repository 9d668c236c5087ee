"""Drive a training job from outside: start it under a launcher, follow its metrics, SIGKILL a worker, stop it.

Used by ``launch/failure_demo.py`` and ``benchmarks/goodput.py``::

    job = TrainJob.start(Launcher.RECYCLE, 4, ["--deepspeed_config", cfg, "--steps", "30"], metrics, log)
    with job:
        tail = MetricsTail(metrics)
        while not tail.poll() ...: ...
        job.kill_rank(1)          # a real SIGKILL of rank 1's process, found through /proc
    # leaving the block stops the launcher and SIGKILLs whatever of the job is left

The launcher runs in its own session with its output in a log file; :meth:`TrainJob.stop` sends it SIGTERM
(both launchers then stop their workers), waits, and SIGKILLs the launcher's process group and every
descendant still alive. Worker pids come from :mod:`ds_recycle.tools.procs` (Linux only).
"""
from __future__ import annotations

import enum
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from ds_recycle.tools.procs import descendants, dump_stacks, rss_bytes, scan_proc, start_ticks, worker_pids

logger = logging.getLogger(__name__)

__all__ = ["Launcher", "TrainJob", "Kill", "MetricsTail", "Watchdog", "REPO", "rank_of"]

REPO = Path(__file__).resolve().parents[2]
TRAIN_SCRIPT = REPO / "launch" / "train.py"


class Launcher(enum.Enum):
    """Which launcher starts the workers."""

    RECYCLE = "ds-recycle launch"
    """``ds-recycle launch``: survivors are kept alive; lost ranks restarted with ``--restart_failed_after``."""
    DEEPSPEED = "deepspeed"
    """DeepSpeed's own launcher: the first worker that dies takes the whole job down (it polls every second)."""

    def command(self, nproc: int, launcher_args: Sequence[str] = ()) -> list[str]:
        """The launcher's command line up to (not including) the training script."""
        if self is Launcher.RECYCLE:
            return [sys.executable, "-m", "ds_recycle", "launch", "--num_accelerators", str(nproc),
                    "--master_port", "0", *launcher_args]
        return [str(Path(sys.executable).parent / "deepspeed"), "--num_accelerators", str(nproc),
                "--master_port", str(_free_port()), *launcher_args]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_of(pipeline: int, stage: int, pipelines: int) -> int:
    """Global rank of worker (pipeline, stage) in a job without absent workers (DeepSpeed's stage-major layout)."""
    return stage * pipelines + pipeline


@dataclass(frozen=True)
class Kill:
    """One SIGKILL sent from outside."""

    time_s: float
    """Unix time of the kill."""
    rank: int
    pid: int


class TrainJob:
    """One launcher process running ``launch/train.py``; a context manager that always cleans up."""

    def __init__(self, proc: subprocess.Popen[bytes], launcher: Launcher, started_at: float, log: Path) -> None:
        self.proc = proc
        self.launcher = launcher
        self.started_at = started_at
        """Unix time just before the launcher was spawned."""
        self.log = log

    @classmethod
    def start(cls, launcher: Launcher, nproc: int, script_args: Sequence[str], log: Path,
              launcher_args: Sequence[str] = (), env: dict[str, str] | None = None) -> TrainJob:
        """Spawn ``<launcher> launch/train.py <script_args>`` with its output in ``log``."""
        cmd = [*launcher.command(nproc, launcher_args), str(TRAIN_SCRIPT), *script_args]
        full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
                    **(env or {})}
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as out:
            started = time.time()
            proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        logger.info("started %s as pid %d: %s", launcher.value, proc.pid, " ".join(cmd))
        return cls(proc, launcher, started, log)

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def pids(self) -> dict[int, int]:
        """``rank -> pid`` of the workers alive now."""
        return worker_pids(self.proc.pid) if self.running else {}

    def kill_rank(self, rank: int) -> Kill | None:
        """SIGKILL the process of ``rank``; None when no live process runs that rank now."""
        pid = self.pids().get(rank)
        if pid is None:
            return None
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None
        logger.info("SIGKILL to rank %d (pid %d)", rank, pid)
        return Kill(time.time(), rank, pid)

    def dump_stacks(self) -> list[int]:
        """SIGUSR1 to every worker that handles it (:func:`ds_recycle.tools.procs.dump_stacks`: every thread's Python
        stack in the job's log); the ranks signalled. For diagnosing a stalled job."""
        ranks = sorted(dump_stacks(self.proc.pid))
        logger.warning("SIGUSR1 (stack dump) to ranks %s of %s", ranks, self.launcher.value)
        return ranks

    def worker_rss(self) -> dict[int, int]:
        """``rank -> resident bytes`` of the live workers."""
        found: dict[int, int] = {}
        for rank, pid in self.pids().items():
            try:
                found[rank] = rss_bytes(Path(f"/proc/{pid}/status").read_text())
            except OSError:
                pass
        return found

    def wait(self, timeout_s: float) -> int | None:
        """The launcher's exit status, or None if it still runs after ``timeout_s``."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace_s: float = 20.0) -> int:
        """SIGTERM the launcher (it stops its workers), then SIGKILL whatever of the job is left."""
        left: dict[int, int | None] = {}
        if self.running:
            left = {pid: start_ticks(pid) for pid in descendants(scan_proc(), self.proc.pid)}
            self.proc.send_signal(signal.SIGTERM)
            if self.wait(grace_s) is None:
                logger.warning("%s did not stop %.0f s after SIGTERM: SIGKILL", self.launcher.value, grace_s)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for pid, started in left.items():  # workers live in sessions of their own
            if started is not None and start_ticks(pid) == started:  # the same process, not a reused pid
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        return self.proc.wait()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def __enter__(self) -> TrainJob:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


@dataclass
class MetricsTail:
    """Follows the reporter's JSON Lines metrics file while the job writes it.

    A restarted reporter (a fallback to a checkpoint) writes the file anew: a file that shrank, or a record
    whose iteration does not follow the last one, starts a new *life*. ``lives`` keeps every record read.
    """

    path: Path
    lives: list[list[dict[str, Any]]] = field(default_factory=list)
    _offset: int = 0
    _partial: bytes = b""

    def poll(self) -> list[dict[str, Any]]:
        """Records written since the last call."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self._offset:
            self._offset, self._partial = 0, b""
            self.lives.append([])
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = self._partial + f.read()
        self._offset += len(data) - len(self._partial)
        *lines, self._partial = data.split(b"\n")
        new = [json.loads(line) for line in lines if line.strip()]
        for rec in new:
            self._add(rec)
        return new

    def _add(self, rec: dict[str, Any]) -> None:
        if not self.lives or (self.lives[-1] and rec["iter"] <= self.lives[-1][-1]["iter"]):
            self.lives.append([])
        self.lives[-1].append(rec)

    @property
    def last(self) -> dict[str, Any] | None:
        return self.lives[-1][-1] if self.lives and self.lives[-1] else None


@dataclass
class Watchdog:
    """Guards a running job: dumps its workers' stacks once per stall, SIGKILLs a worker whose memory runs away.

    A *stall*: the job has recorded at least one iteration and none in the last ``stall_s`` seconds; every
    worker then gets SIGUSR1 (stacks in the job's log). A *runaway*: a worker holding more than ``max_rss_gib``
    of resident memory; after a stack dump it is SIGKILLed, since on a shared machine the kernel's OOM killer
    would otherwise pick a process, maybe someone else's. Memory is looked at once a second.
    """

    stall_s: float = 30.0
    max_rss_gib: float = 3.0
    stalls: list[float] = field(default_factory=list)
    """Unix times of the stack dumps for stalls."""
    runaways: list[tuple[Kill, float]] = field(default_factory=list)
    """Workers killed for their memory, with the GiB they held."""
    _next_memory_check: float = 0.0

    def check(self, job: TrainJob, tail: MetricsTail) -> None:
        """Call often while the job runs."""
        now = time.time()
        if now >= self._next_memory_check:
            self._next_memory_check = now + 1.0
            self._guard_memory(job)
        last = tail.last
        if job.running and last is not None and now - last["unix_time"] > self.stall_s and not (
                self.stalls and self.stalls[-1] > last["unix_time"]):
            logger.warning("%s: no iteration finished for %.0f s (last %d): stack dump, see %s", job.launcher.value,
                           now - last["unix_time"], last["iter"], job.log)
            job.dump_stacks()
            self.stalls.append(now)

    def _guard_memory(self, job: TrainJob) -> None:
        for rank, rss in job.worker_rss().items():
            if rss > self.max_rss_gib * 2**30:
                logger.warning("%s: rank %d holds %.1f GiB (> %g): stack dump, then SIGKILL", job.launcher.value,
                               rank, rss / 2**30, self.max_rss_gib)
                job.dump_stacks()
                time.sleep(2.0)
                kill = job.kill_rank(rank)
                if kill is not None:
                    self.runaways.append((kill, rss / 2**30))
