"""Which process runs which rank of a job: its launcher's descendants and the ``RANK`` in their environment.

Linux only (reads ``/proc``). Every launcher we use (``ds-recycle launch``, ``deepspeed``, ``torchrun``) gives
each worker its global rank in the ``RANK`` environment variable; the worker of rank ``r`` is the topmost
descendant of the launcher whose environment says ``RANK=r`` (its own children, if any, inherit the variable).
A worker that ``ds-recycle launch`` forked from its fork server has the server's ``/proc/<pid>/environ`` (the file
shows the environment a process was started with): it names itself ``ds-rank-<r>`` instead
(:func:`ds_recycle.launcher.forkserver.process_name`), which is what ``/proc/<pid>/comm`` and ``ps`` show.
The parsing functions are pure, so they are tested on hand-written ``/proc`` text.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ProcInfo", "parse_stat", "stat_name", "parse_environ", "caught_signals", "catches", "rss_bytes", "start_ticks",
           "descendants", "dump_stacks", "rank_pids", "scan_proc", "worker_pids"]


@dataclass(frozen=True)
class ProcInfo:
    """What we need of one process."""

    pid: int
    ppid: int
    rank: int | None
    """The ``RANK`` of its environment, None when absent or not a number."""


_FORKED = re.compile(r"^ds-rank-(\d+)$")
"""The name a forked worker of ``ds-recycle launch`` gives itself."""


def parse_stat(text: str) -> tuple[int, int]:
    """``(pid, ppid)`` from the text of ``/proc/<pid>/stat`` (the command name may hold spaces and parentheses)."""
    head, sep, tail = text.rpartition(")")
    if not sep:
        raise ValueError(f"not a /proc/<pid>/stat line: {text[:80]!r}")
    fields = tail.split()
    if len(fields) < 2:
        raise ValueError(f"/proc/<pid>/stat line without a parent pid: {text[:80]!r}")
    return int(head.split("(", 1)[0]), int(fields[1])


def stat_name(text: str) -> str:
    """The command name of a ``/proc/<pid>/stat`` line (what ``/proc/<pid>/comm`` holds)."""
    head, sep, _ = text.rpartition(")")
    if not sep or "(" not in head:
        raise ValueError(f"not a /proc/<pid>/stat line: {text[:80]!r}")
    return head.split("(", 1)[1]


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, field 22 of its stat line); None if it is gone.
    With the pid, it names one process: a pid alone may be reused by an unrelated process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(text.rpartition(")")[2].split()[19])


def parse_environ(raw: bytes) -> dict[str, str]:
    """The variables of ``/proc/<pid>/environ`` (NUL-separated ``KEY=VALUE``)."""
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def caught_signals(status_text: str) -> frozenset[int]:
    """Signal numbers a process has handlers for, from the ``SigCgt`` mask of ``/proc/<pid>/status``."""
    for line in status_text.splitlines():
        if line.startswith("SigCgt:"):
            mask = int(line.split()[1], 16)
            return frozenset(n + 1 for n in range(64) if mask >> n & 1)
    raise ValueError("no SigCgt line: not a /proc/<pid>/status text")


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` now (False if it is gone); Linux."""
    try:
        return signum in caught_signals(Path(f"/proc/{pid}/status").read_text())
    except (OSError, ValueError):
        return False


def rss_bytes(status_text: str) -> int:
    """Resident memory from the ``VmRSS`` line of ``/proc/<pid>/status`` (0 when absent: a zombie)."""
    for line in status_text.splitlines():
        if line.startswith("VmRSS:"):
            value, unit = line.split()[1:3]
            if unit != "kB":
                raise ValueError(f"VmRSS in {unit!r}, expected kB")
            return int(value) * 1024
    return 0


def _rank(env: Mapping[str, str], name: str = "") -> int | None:
    """The worker's rank: its ``RANK``, or the one in its name when it was forked (its environ is the server's)."""
    forked = _FORKED.match(name)
    if forked:
        return int(forked[1])
    text = env.get("RANK")
    return int(text) if text is not None and text.isdigit() else None


def descendants(procs: Mapping[int, ProcInfo], root: int) -> list[int]:
    """Pids of every descendant of ``root`` (not ``root`` itself), parents before children."""
    children: dict[int, list[int]] = {}
    for info in procs.values():
        children.setdefault(info.ppid, []).append(info.pid)
    found: list[int] = []
    frontier = [root]
    while frontier:
        nxt = [c for pid in frontier for c in sorted(children.get(pid, ()))]
        found.extend(nxt)
        frontier = nxt
    return found


def rank_pids(procs: Mapping[int, ProcInfo], root: int) -> dict[int, int]:
    """``rank -> pid`` of the workers under ``root``: the topmost descendant carrying each ``RANK``."""
    found: dict[int, int] = {}
    for pid in descendants(procs, root):
        info = procs[pid]
        parent = procs.get(info.ppid)
        if info.rank is not None and info.rank not in found and (parent is None or parent.rank != info.rank):
            found[info.rank] = pid
    return found


def _read_proc(entry: Path) -> ProcInfo | None:
    try:
        stat = (entry / "stat").read_text()
        pid, ppid = parse_stat(stat)
        env = parse_environ((entry / "environ").read_bytes())
    except (OSError, ValueError):  # gone meanwhile, or not ours to read
        return None
    return ProcInfo(pid, ppid, _rank(env, stat_name(stat)))


def scan_proc(proc_root: str = "/proc") -> dict[int, ProcInfo]:
    """Every process of ``/proc`` this user can read."""
    procs: dict[int, ProcInfo] = {}
    for entry in Path(proc_root).iterdir():
        if entry.name.isdigit():
            info = _read_proc(entry)
            if info is not None:
                procs[info.pid] = info
    return procs


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """``rank -> pid`` of the live workers of the job started by ``launcher_pid`` (Linux)."""
    if not os.path.isdir("/proc"):
        raise OSError("finding worker processes needs Linux's /proc")
    return rank_pids(scan_proc(), launcher_pid)


def dump_stacks(launcher_pid: int) -> dict[int, int]:
    """SIGUSR1 to every worker of the job started by ``launcher_pid`` that handles it (workers started through
    ``ds-recycle launch``'s bootstrap, or ``launch/train.py``, write every thread's Python stack to their stderr, the
    job's log, and carry on); ``rank -> pid`` of those signalled. A process still starting, without the handler yet,
    would die of SIGUSR1: it is left alone. For diagnosing a stalled job."""
    import signal

    signalled = {}
    for rank, pid in worker_pids(launcher_pid).items():
        if catches(pid, signal.SIGUSR1):
            try:
                os.kill(pid, signal.SIGUSR1)
                signalled[rank] = pid
            except ProcessLookupError:
                pass
    return signalled
