"""Workers forked from a preloaded process: a worker (or a restarted one) starts without importing torch again.

A fresh Python worker spends most of its start-up importing torch, ``torch._dynamo`` (every torch optimizer pulls
it in) and DeepSpeed: about 2.5 s of CPU each, before it does anything of the job. A fork server imports them once;
each worker is then a fork of it that becomes ``python -u -m ds_recycle.launcher.bootstrap ...`` in place, in
tens of milliseconds, and shares the imported modules' memory with its siblings. A restarted worker rejoins
sooner for the same reason.

The launcher starts one :class:`ForkServer` per node (``--preload``, on by default where no CUDA device is
visible: a parent that touched CUDA cannot fork workers that use it) and talks to it over a Unix socket:

- a request carries the worker's argv, environment and working directory, and the write ends of its output
  pipes (passed as file descriptors); the server forks, the child takes them as stdin/stdout/stderr, starts its
  own session (the launcher signals each worker's process group), asks Linux to SIGKILL it when the server dies
  (the server dies with the launcher), names itself ``ds-rank-<R>`` (``/proc/<pid>/comm``: its environment file
  is the server's, see :mod:`ds_recycle.tools.procs`), takes its environment and runs the bootstrap as
  ``__main__``;
- the server answers with the child's pid, reaps its children and reports each exit status.

The server freezes its objects (``gc.freeze``) once the modules are imported, before the first fork: a worker's
garbage collections then leave the shared imported objects alone instead of touching every one of them (which
copies each page they lie on into the worker: copy-on-write), and so does a scan of every object at exit
(:func:`ds_recycle.launcher.leave.open_file_objects`, 0.4-1.0 s a worker of a 2 x 2 job on 2 cores before the freeze).

Anything the server cannot serve (another program than the bootstrap, a server that died) starts as a fresh
process instead, so the fork server changes how fast workers start, never whether they do.

    python -u -c "...forkserver import main; main(sys.argv[1:])" FD MODULE[,MODULE...]   # started by the launcher
"""
from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["BOOTSTRAP", "PRELOAD", "ForkServer", "ForkedProcess", "process_name"]

logger = logging.getLogger("ds_recycle.launcher")

BOOTSTRAP = "ds_recycle.launcher.bootstrap"
PRELOAD = ("torch", "torch._dynamo", "deepspeed", "ds_recycle.api")
"""What the server imports before it forks anybody (``ds_recycle.api`` brings the engine and DeepSpeed's pipe)."""
_PER_RANK = ("RANK", "LOCAL_RANK", "GROUP_RANK", "CROSS_RANK", "TORCHELASTIC_RESTART_COUNT", "DS_RECYCLE_RESTART_COUNT")
"""Variables that differ between a node's workers: left out of the server's own environment."""
_MESSAGE = 1 << 20
_SERVER = "import sys; from ds_recycle.launcher.forkserver import main; main(sys.argv[1:])"
"""The server's program (``-c``: run as ``-m`` it would be imported twice, once by its package)."""
_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15


def process_name(rank: int) -> str:
    """The name a forked worker of ``rank`` gives itself (``/proc/<pid>/comm``, at most 15 bytes)."""
    return f"ds-rank-{rank}"


@dataclass
class ForkedProcess:
    """A worker forked by the server: what the launcher uses of a ``subprocess.Popen`` (it is not our child)."""

    pid: int
    server: ForkServer
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_status(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode


class ForkServer:
    """The launcher's end of a fork server (see the module docstring)."""

    def __init__(self, env: Mapping[str, str], wrap: Callable[[list[str]], list[str]] = list,
                 python: str = sys.executable, preload: Sequence[str] = PRELOAD) -> None:
        """Start the server with the workers' common environment (their per-rank variables left out); ``wrap``
        turns its command line into the one that starts it (the launcher's: it dies with the launcher)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.python = python
        base = {k: v for k, v in env.items() if k not in _PER_RANK}
        argv = wrap([python, "-u", "-c", _SERVER, str(theirs.fileno()), ",".join(preload)])
        self._proc = subprocess.Popen(argv, env=base, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                                      start_new_session=True)
        theirs.close()
        self._sock = ours
        self._lock = threading.Condition()
        self._spawning = threading.Lock()  # one request at a time: replies come back in order
        self._replies: list[dict[str, Any]] = []
        self._exits: dict[int, int] = {}
        self._alive = True
        self._reader = threading.Thread(target=self._read, name="fork server", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ launcher side
    def serves(self, argv: Sequence[str]) -> bool:
        """Whether ``argv`` is a worker this server can fork (the bootstrap under the same interpreter)."""
        return self._alive and tuple(argv[:4]) == (self.python, "-u", "-m", BOOTSTRAP)

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], stdout_fd: int, stderr_fd: int,
              timeout_s: float = 60.0) -> ForkedProcess | None:
        """Fork a worker running ``argv`` (None: the server cannot, start a fresh process instead)."""
        request = json.dumps({"argv": list(argv), "env": dict(env), "cwd": os.getcwd()}).encode()
        with self._spawning, self._lock:
            if not self._alive:
                return None
            try:
                socket.send_fds(self._sock, [request], [stdout_fd, stderr_fd])
            except OSError as err:
                logger.warning("fork server unreachable (%s): workers start as fresh processes", err)
                return None
            deadline = time.monotonic() + timeout_s
            while not self._replies and self._alive and time.monotonic() < deadline:
                self._lock.wait(0.1)
            if not self._replies:
                logger.warning("fork server did not answer: workers start as fresh processes")
                return None
            reply = self._replies.pop(0)
        if "pid" not in reply:
            logger.warning("fork server refused (%s): workers start as fresh processes", reply.get("error"))
            return None
        return ForkedProcess(int(reply["pid"]), self)

    def exit_status(self, pid: int) -> int | None:
        """The exit status of forked worker ``pid`` once it has exited (negative: the signal that killed it)."""
        with self._lock:
            if pid in self._exits:
                return self._exits[pid]
            alive = self._alive
        if alive:
            return None
        try:  # the server died and took its workers along (they asked for SIGKILL at its death)
            os.kill(pid, 0)
        except ProcessLookupError:
            return -int(signal.SIGKILL)
        return None

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the server (its workers must have exited: they die with it)."""
        with self._lock:
            self._alive = False
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(_MESSAGE)
            except OSError:
                data = b""
            with self._lock:
                if not data:
                    self._alive = False
                    self._lock.notify_all()
                    return
                message = json.loads(data)
                if "exit" in message:
                    self._exits[int(message["exit"])] = int(message["status"])
                else:
                    self._replies.append(message)
                self._lock.notify_all()
            if "exit" in message:  # wake the launcher as a child's own exit would (its wait ends on SIGCHLD)
                os.kill(os.getpid(), signal.SIGCHLD)


# ---------------------------------------------------------------------------------------------- the server
def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _serve(sock: socket.socket) -> dict[str, Any] | None:
    """Fork workers on request until the launcher goes away; in a forked child, return its request."""
    me = os.getpid()
    children: set[int] = set()
    while True:
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                sock.send(json.dumps({"exit": pid, "status": os.waitstatus_to_exitcode(status)}).encode())
        ready, _, _ = select.select([sock], [], [], 0.02)
        if not ready:
            continue
        data, fds, _, _ = socket.recv_fds(sock, _MESSAGE, 2)
        if not data:  # the launcher closed its end: no more workers to start
            return None
        if threading.active_count() != 1:  # a fork copies only this thread: refuse rather than risk a deadlock
            sock.send(json.dumps({"error": f"{threading.active_count()} threads in the fork server"}).encode())
            for fd in fds:
                os.close(fd)
            continue
        pid = os.fork()
        if pid == 0:
            _become_worker(me, sock, fds)
            request: dict[str, Any] = json.loads(data)
            return request
        for fd in fds:
            os.close(fd)
        children.add(pid)
        sock.send(json.dumps({"pid": pid}).encode())


def _become_worker(server_pid: int, sock: socket.socket, fds: list[int]) -> None:
    """In the forked child: its own session, death with the server, its output pipes as stdin/stdout/stderr."""
    sock.close()
    os.setsid()
    libc = _libc()
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != server_pid:  # the server died between the fork and the request above
        os._exit(128 + int(signal.SIGKILL))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in {devnull, *fds}:
        os.close(fd)


def _run_worker(request: dict[str, Any]) -> None:
    """Become ``python -u -m ds_recycle.launcher.bootstrap ARGS`` with the request's environment and directory."""
    import runpy

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    rank = request["env"].get("RANK", "")
    if rank.isdigit():
        _libc().prctl(_PR_SET_NAME, process_name(int(rank)).encode()[:15], 0, 0, 0)
    sys.argv = [BOOTSTRAP, *request["argv"][4:]]
    runpy.run_module(BOOTSTRAP, run_name="__main__", alter_sys=True)


def main(argv: Sequence[str] | None = None) -> None:
    fd, modules = (list(argv) if argv is not None else sys.argv[1:])[:2]
    import importlib

    for module in modules.split(","):
        importlib.import_module(module)
    gc.collect()
    gc.freeze()  # the workers' collections (and leave.py's scan for open files) skip what they share with the server
    with socket.socket(fileno=int(fd)) as sock:
        request = _serve(sock)
    if request is None:  # the launcher closed the socket: nothing to flush, no module teardown to wait for
        os._exit(0)
    _run_worker(request)  # a forked worker: run the bootstrap as this process's main program (it ends the process)


if __name__ == "__main__":
    main()
