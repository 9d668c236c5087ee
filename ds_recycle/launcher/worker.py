"""One child process of the launcher: spawn it, forward its output, poll its exit, signal it.

A :class:`Worker` owns one rank (or, on node 0 of a multi-host job, one remote launcher reached over ssh). It
can be started again after it exits (:meth:`Worker.start` with a higher restart count), which is what a
restarted rank is.

Every child runs in its own session (``start_new_session=True``), so a Ctrl-C in the launcher's terminal reaches
the launcher only, and the launcher decides whom to signal. Signals go to the child's whole process group, so
helper processes the child started (data loaders, compilers) go with it. On Linux the child is also started
through a tiny shim that sets ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` before ``exec``: if the launcher is
SIGKILLed, its workers die with it instead of being orphaned. Linux sends that signal when the *thread* that
started the child exits, so workers must be started from the launcher's long-lived supervisor thread.

With a :class:`~ds_recycle.launcher.forkserver.ForkServer`, a Python worker is forked from it instead (same
session, signals, output and death-with-the-launcher rules; start-up without importing torch again).
"""
from __future__ import annotations

import enum
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import IO, TextIO

from ds_recycle.launcher.forkserver import ForkedProcess, ForkServer

__all__ = ["LOST_EXIT_CODE", "ExitKind", "exit_kind", "WorkerExit", "WorkerSpec", "Worker", "OutputSink", "describe_returncode",
           "pdeathsig_argv"]

#: A worker that exits with this code (sysexits' EX_TEMPFAIL) declares itself lost, like a killed process: the
#: job goes on without it. Exported to workers as ``DS_RECYCLE_LOST_EXIT_CODE``.
LOST_EXIT_CODE = 75

# Run as `python -c _PDEATHSIG_SHIM <launcher pid> <argv...>`: ask Linux to SIGKILL this process when its parent
# dies, give up if the parent is already gone, then become the real worker (same pid).
_PDEATHSIG_SHIM = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)\n"  # 1 = PR_SET_PDEATHSIG
    "if os.getppid() != int(sys.argv[1]): os._exit(128 + int(signal.SIGKILL))\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def pdeathsig_argv(argv: list[str]) -> list[str]:
    """``argv`` started so that the process dies with this one (Linux; elsewhere ``argv`` as it is)."""
    if sys.platform.startswith("linux"):
        return [sys.executable, "-c", _PDEATHSIG_SHIM, str(os.getpid()), *argv]
    return list(argv)


class ExitKind(enum.Enum):
    """What a worker's exit means for the job."""

    FINISHED = "finished"
    """Exit code 0: the worker's program completed."""
    LOST = "lost"
    """Killed by a signal, or exit code :data:`LOST_EXIT_CODE`: the worker is gone (a crash, the OOM killer, an
    injected failure); the others may carry on without it."""
    ERROR = "error"
    """Any other non-zero code: the program gave up (an exception, a bad config). The job has failed."""


def exit_kind(returncode: int) -> ExitKind:
    """Classify a return code (negative: killed by that signal)."""
    if returncode == 0:
        return ExitKind.FINISHED
    if returncode < 0 or returncode == LOST_EXIT_CODE:
        return ExitKind.LOST
    return ExitKind.ERROR


def describe_returncode(returncode: int) -> str:
    """``"exit code 1"`` or ``"signal SIGKILL"`` (negative return codes are signals, as in :mod:`subprocess`)."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


@dataclass(frozen=True)
class WorkerExit:
    """One exit of one worker process, as the launcher saw it."""

    name: str
    rank: int | None
    pid: int
    returncode: int
    elapsed_s: float
    """Seconds from this process's start to its exit."""
    restart_count: int
    stopped_by_launcher: bool
    """True when the launcher had signalled it (a stop of the whole job), so the exit is not the worker's doing."""

    @property
    def kind(self) -> ExitKind:
        return exit_kind(self.returncode)

    def describe(self) -> str:
        how = describe_returncode(self.returncode) + (" (stopped by the launcher)" if self.stopped_by_launcher else "")
        restart = f", restart {self.restart_count}" if self.restart_count else ""
        return f"{self.name} (pid {self.pid}{restart}) {self.kind.value}: {how} after {self.elapsed_s:.2f} s"


@dataclass(frozen=True)
class WorkerSpec:
    """How to start one child: its command line and environment (``rank`` is None for a remote launcher)."""

    name: str
    rank: int | None
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(hash=False)
    show_stdout: bool = True
    """False: stdout is discarded and only stderr is forwarded (``--log_ranks`` left this rank out)."""
    prefix: str = ""
    """Put in front of every forwarded line, e.g. ``"[rank 3] "``."""


class OutputSink:
    """Where children's output lines go: one text stream shared by all, written one whole line at a time."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._lock = threading.Lock()
        self._broken = False

    def write_line(self, line: str) -> None:
        with self._lock:
            if self._broken:
                return
            try:
                self._stream.write(line if line.endswith("\n") else line + "\n")
                self._stream.flush()
            except (OSError, ValueError):  # e.g. the ssh session that carried it is gone: keep draining, drop lines
                self._broken = True

    def pump(self, pipe: IO[bytes], prefix: str) -> threading.Thread:
        """Forward ``pipe`` line by line until EOF, in a daemon thread."""
        def run() -> None:
            with pipe:
                for raw in iter(pipe.readline, b""):
                    self.write_line(prefix + raw.decode("utf-8", errors="replace"))
        thread = threading.Thread(target=run, name=f"output {prefix.strip()}", daemon=True)
        thread.start()
        return thread


class Worker:
    """One child process slot: started, polled and signalled by the supervisor's thread only."""

    def __init__(self, spec: WorkerSpec, sink: OutputSink, forkserver: ForkServer | None = None) -> None:
        self.spec = spec
        self._sink = sink
        self._forkserver = forkserver
        self._proc: subprocess.Popen[bytes] | ForkedProcess | None = None
        self._pumps: list[threading.Thread] = []
        self._started_at = 0.0
        self.restart_count = 0
        self._signalled = False

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    def start(self, restart_count: int = 0, extra_env: Mapping[str, str] | None = None) -> None:
        """Spawn the process (again, after an exit); ``extra_env`` adds to the spec's environment."""
        if self.running:
            raise RuntimeError(f"{self.spec.name} is already running as pid {self.pid}")
        env = {**self.spec.env, **(extra_env or {})}
        pipe = self._fork(env) if self._forkserver is not None else None
        if pipe is None:
            self._proc = subprocess.Popen(
                pdeathsig_argv(list(self.spec.argv)), env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if self.spec.show_stdout else subprocess.DEVNULL,
                stderr=subprocess.STDOUT if self.spec.show_stdout else subprocess.PIPE,
                start_new_session=True)
            pipe = self._proc.stdout if self.spec.show_stdout else self._proc.stderr
        self._started_at = time.monotonic()
        self.restart_count = restart_count
        self._signalled = False
        assert pipe is not None
        self._pumps.append(self._sink.pump(pipe, self.spec.prefix))

    def _fork(self, env: Mapping[str, str]) -> IO[bytes] | None:
        """Start the worker as a fork of the fork server; its output pipe, or None when the server cannot."""
        server = self._forkserver
        if server is None or not server.serves(self.spec.argv):
            return None
        read_fd, write_fd = os.pipe()
        quiet = os.open(os.devnull, os.O_WRONLY) if not self.spec.show_stdout else write_fd
        try:
            proc = server.spawn(self.spec.argv, env, quiet, write_fd)
        finally:
            os.close(write_fd)
            if quiet != write_fd:
                os.close(quiet)
        if proc is None:
            os.close(read_fd)
            return None
        self._proc = proc
        return os.fdopen(read_fd, "rb")

    def poll(self) -> WorkerExit | None:
        """The exit, once, if the process has exited since the last call; its leftover process group is killed."""
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return None
        try:  # look without reaping: while the leader is a zombie its group id cannot be reused
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                return None
        except ChildProcessError:  # reaped by someone else: subprocess knows the code
            if proc.poll() is None:
                return None
        self._kill_group(signal.SIGKILL)
        returncode = proc.wait()
        return WorkerExit(self.spec.name, self.spec.rank, proc.pid, returncode, time.monotonic() - self._started_at,
                          self.restart_count, self._signalled)

    def send_signal(self, sig: signal.Signals) -> None:
        """Signal the running process's whole group; a no-op once it has exited."""
        if self.running:
            self._signalled = True
            self._kill_group(sig)

    def join_output(self, timeout_s: float) -> None:
        """Wait (bounded) until every output line of past runs has been forwarded."""
        deadline = time.monotonic() + timeout_s
        for pump in self._pumps:
            pump.join(max(0.0, deadline - time.monotonic()))

    def _kill_group(self, sig: signal.Signals) -> None:
        assert self._proc is not None
        try:
            os.killpg(self._proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
