"""Run user-style DeepSpeed scripts from tests: stock launchers, ``ds-recycle launch``, and their comparison.

- :func:`recycle_variant` makes the ds_recycle version of a script by the documented one-line change;
- :func:`start_torchrun`, :func:`start_deepspeed`, :func:`start_ds_recycle` start a script under
  ``python -m torch.distributed.run --standalone``, DeepSpeed's ``deepspeed --num_accelerators N`` and
  ``ds-recycle launch --num_accelerators N``; each returns a :class:`Job` (its own process group, output
  collected line by line, :meth:`Job.kill_rank` for faults); :meth:`Job.result` waits (bounded) and gives a
  :class:`Run`; ``run_*`` do both;
- :func:`assert_same_final` compares two final-parameter files (rtol 1e-5), :func:`identical` bit for bit.

Every job runs with ``OMP_NUM_THREADS=1``, ``DS_ACCELERATOR=cpu``, wandb disabled, and ``site/`` first on
``PYTHONPATH``: its ``sitecustomize.py`` makes DeepSpeed skip the JIT build of its CPU shared-memory op in
``deepspeed.init_distributed()`` without changing the script. ``TORCH_EXTENSIONS_DIR`` points into the job's
folder, so :meth:`Run.jit_builds` shows any op that was compiled anyway.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher
from pathlib import Path
from typing import TypeVar

import torch

from ds_recycle.events import Event, parse_event
from ds_recycle.tools.compare import compare_state_dicts
from ds_recycle.tools.procs import descendants, dump_stacks, scan_proc, worker_pids
from tests.harness import hang_report

__all__ = [
    "BYOM",
    "REPO",
    "RUN_TIMEOUT_S",
    "SITE",
    "STEPS",
    "USER_TRAIN",
    "Job",
    "Run",
    "VanillaRuns",
    "assert_same_final",
    "free_port",
    "identical",
    "recycle_variant",
    "run_deepspeed",
    "run_ds_recycle",
    "run_torchrun",
    "script_args",
    "start_deepspeed",
    "start_ds_recycle",
    "start_torchrun",
    "write_recycle_variant",
]

BYOM = Path(__file__).resolve().parent
REPO = BYOM.parents[1]
USER_TRAIN = BYOM / "user_train.py"
SITE = REPO / "tests" / "site"
VENV_BIN = Path(sys.executable).parent

STEPS = 20
RUN_TIMEOUT_S = 150.0
"""One 4-process run of 20 steps takes 10-30 s on an idle 2-core machine; the rest is margin for a busy one."""

_IMPORT = "import deepspeed"
_CALL = re.compile(r"(?<![\w.])deepspeed\.initialize\(")
_EVENT = re.compile(r"\bevent (\{.*\})\s*$", re.MULTILINE)
"""A worker's ``event {...}`` log line (the failure handler logs each event's JSON form)."""
E = TypeVar("E", bound=Event)
_LOSS = re.compile(r"^(?:\[rank \d+\] )?step (\d+) loss ([-+0-9.einf]+)\s*$", re.MULTILINE)


# ---------------------------------------------------------------------------------------------- the variant
def recycle_variant(source: str) -> str:
    """``source`` with ``import ds_recycle`` after its ``import deepspeed`` and ``ds_recycle.initialize(``
    for its one ``deepspeed.initialize(``; asserts that exactly those lines changed."""
    lines = source.splitlines(keepends=True)
    imports = [i for i, line in enumerate(lines) if line.strip() == _IMPORT]
    calls = [i for i, line in enumerate(lines) if _CALL.search(line)]
    assert len(imports) == 1, f"the script needs exactly one '{_IMPORT}' line, found {len(imports)}"
    assert len(calls) == 1 and len(_CALL.findall(lines[calls[0]])) == 1, \
        f"the script needs exactly one 'deepspeed.initialize(' call, found it on lines {[c + 1 for c in calls]}"
    (imp,), (call,) = imports, calls
    indent = lines[imp][: len(lines[imp]) - len(lines[imp].lstrip())]
    out = list(lines)
    out[call] = _CALL.sub("ds_recycle.initialize(", lines[call])
    out.insert(imp + 1, f"{indent}import ds_recycle\n")
    _assert_only_documented_change(lines, out, imp, call)
    return "".join(out)


def _assert_only_documented_change(before: list[str], after: list[str], imp: int, call: int) -> None:
    changes = [op for op in SequenceMatcher(a=before, b=after, autojunk=False).get_opcodes() if op[0] != "equal"]
    inserted = [(tag, i1, i2, after[j1:j2]) for tag, i1, i2, j1, j2 in changes if tag == "insert"]
    replaced = [(tag, i1, i2, j2 - j1) for tag, i1, i2, j1, j2 in changes if tag == "replace"]
    assert len(changes) == 2 and inserted and replaced, f"unexpected changes {changes}"
    assert inserted[0][1:3] == (imp + 1, imp + 1) and [s.strip() for s in inserted[0][3]] == ["import ds_recycle"]
    assert replaced[0][1:] == (call, call + 1, 1), f"changed more than the initialize line: {replaced}"
    assert after[call + 1].replace("ds_recycle.initialize(", "deepspeed.initialize(") == before[call]


def write_recycle_variant(script: Path, folder: Path) -> Path:
    """Write :func:`recycle_variant` of ``script`` into ``folder`` under the same name; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / script.name
    target.write_text(recycle_variant(script.read_text()))
    return target


# ---------------------------------------------------------------------------------------------- running
def script_args(model: str, config: str = "fp32", steps: int = STEPS) -> list[str]:
    """``user_train.py``'s arguments for ``model`` with ``configs/<config>.json``."""
    return ["--deepspeed_config", str(BYOM / "configs" / f"{config}.json"), "--model", model, "--steps", str(steps)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Run:
    """A finished job: its exit status, everything it printed, and its final-parameter file if written."""

    returncode: int
    log: str
    final: Path | None
    workdir: Path
    seconds: float

    def losses(self) -> list[float]:
        """The ``step N loss X`` values in step order (one per step, whichever rank printed it)."""
        by_step: dict[int, float] = {}
        for step, value in _LOSS.findall(self.log):
            by_step.setdefault(int(step), float(value))
        return [by_step[s] for s in sorted(by_step)]

    def events(self, kind: type[E]) -> list[E]:
        """The events of type ``kind`` the workers logged (their ``event {...}`` lines, one copy per survivor), read
        through :mod:`ds_recycle.events`."""
        found = [parse_event(json.loads(raw)) for raw in _EVENT.findall(self.log)]
        return [e for e in found if isinstance(e, kind)]

    def jit_builds(self) -> list[str]:
        """Ops compiled into this job's ``TORCH_EXTENSIONS_DIR`` (empty when nothing was built)."""
        root = self.workdir / "torch_extensions"
        return sorted(p.name for p in root.glob("*/*")) if root.is_dir() else []

    def check(self) -> Run:
        """Raise with the log's tracebacks and tail unless the job exited 0 and wrote its final file."""
        assert self.returncode == 0, f"exit {self.returncode}:\n{_tracebacks(self.log)}\n...\n{self.log[-4000:]}"
        assert self.final is not None, f"no final-parameter file:\n{self.log[-3000:]}"
        return self


def _tracebacks(log: str, most: int = 3, lines: int = 40) -> str:
    """The first ``most`` tracebacks in ``log`` (``lines`` lines each), which the tail alone often cuts off."""
    rows = log.splitlines()
    starts = [i for i, row in enumerate(rows) if "Traceback (most recent call last)" in row][:most]
    return "\n".join("\n".join(rows[i:i + lines]) for i in starts)


class Job:
    """A launcher process in its own session; its output is collected by a thread."""

    def __init__(self, cmd: Sequence[str], workdir: Path, final: Path, pythonpath: Sequence[Path],
                 env: dict[str, str] | None = None) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        final.unlink(missing_ok=True)
        path = os.pathsep.join(str(p) for p in (SITE, *pythonpath, REPO))
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled",
                    "PYTHONPATH": path, "TORCH_EXTENSIONS_DIR": str(workdir / "torch_extensions"),
                    "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", **(env or {})}
        self.cmd, self.workdir, self.final = list(cmd), workdir, final
        self.started = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, cwd=workdir, env=full_env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()

    @property
    def log(self) -> str:
        with self._changed:
            return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> str:
        """Block until a line matches ``pattern`` (a regex); returns it. Raises on timeout or exit."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    if regex.search(line):
                        return line
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    why = "timed out" if left <= 0 else f"job exited {self.proc.returncode}"
                    raise AssertionError(f"{why} waiting for {pattern!r}:\n{''.join(self.lines)[-4000:]}")
                self._changed.wait(min(left, 0.2))

    def kill_rank(self, rank: int, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to the worker of global ``rank`` (found through ``/proc``); returns its pid."""
        pids = worker_pids(self.proc.pid)
        assert rank in pids, f"no live worker of rank {rank} under pid {self.proc.pid}: {pids}"
        os.kill(pids[rank], sig)
        return pids[rank]

    def result(self, timeout: float) -> Run:
        """Wait for the job (at most ``timeout`` s from its start); kills its process group on timeout."""
        try:
            self.proc.wait(timeout=max(1.0, self.started + timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            if dump_stacks(self.proc.pid):  # every thread's stack of every worker into the log, to see the hang
                time.sleep(2.0)
            self.close()
            self._reader.join(timeout=10)
            raise AssertionError(f"job timed out after {timeout} s: {' '.join(self.cmd)}\n{hang_report(self.log)}") \
                from None
        finally:
            self.close()
        self._reader.join(timeout=10)
        final = self.final if self.final.is_file() else None
        return Run(self.proc.returncode, self.log, final, self.workdir, time.monotonic() - self.started)

    def close(self) -> None:
        """Kill whatever is left of the job (idempotent): every descendant, then the launcher's process group.

        Descendants are killed by pid because launchers may start workers in sessions of their own (torchrun
        does), where killing the launcher's group would leave them running.
        """
        if self.proc.poll() is None:
            for pid in reversed(descendants(scan_proc(), self.proc.pid)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _script_args(script_args: Sequence[str], final: Path) -> list[str]:
    return [*script_args, "--save-final", str(final)]


def start_torchrun(script: Path, script_args: Sequence[str], workdir: Path, nproc: int = 4,
                   pythonpath: Sequence[Path] = (BYOM,), env: dict[str, str] | None = None) -> Job:
    """``python -m torch.distributed.run --standalone --nproc_per_node N SCRIPT ARGS --save-final F``."""
    final = workdir / "final.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(script), *_script_args(script_args, final)]
    return Job(cmd, workdir, final, pythonpath, env)


def start_deepspeed(script: Path, script_args: Sequence[str], workdir: Path, nproc: int = 4,
                    pythonpath: Sequence[Path] = (BYOM,), env: dict[str, str] | None = None) -> Job:
    """DeepSpeed's launcher: ``deepspeed --num_accelerators N --master_port P SCRIPT ARGS --save-final F``."""
    final = workdir / "final.pt"
    cmd = [str(VENV_BIN / "deepspeed"), "--num_accelerators", str(nproc), "--master_port", str(free_port()),
           str(script), *_script_args(script_args, final)]
    return Job(cmd, workdir, final, pythonpath, env)


def start_ds_recycle(script: Path, script_args: Sequence[str], workdir: Path, nproc: int = 4,
                     launcher_args: Sequence[str] = (), pythonpath: Sequence[Path] = (BYOM,),
                     env: dict[str, str] | None = None) -> Job:
    """``ds-recycle launch --num_accelerators N --master_port 0 [LAUNCHER_ARGS] SCRIPT ARGS --save-final F``."""
    final = workdir / "final.pt"
    cmd = [sys.executable, "-m", "ds_recycle", "launch", "--num_accelerators", str(nproc), "--master_port", "0",
           *launcher_args, str(script), *_script_args(script_args, final)]
    return Job(cmd, workdir, final, pythonpath, env)


def run_torchrun(script: Path, script_args: Sequence[str], workdir: Path, timeout: float, nproc: int = 4,
                 pythonpath: Sequence[Path] = (BYOM,), env: dict[str, str] | None = None) -> Run:
    """:func:`start_torchrun`, then :meth:`Job.result`."""
    return start_torchrun(script, script_args, workdir, nproc, pythonpath, env).result(timeout)


def run_deepspeed(script: Path, script_args: Sequence[str], workdir: Path, timeout: float, nproc: int = 4,
                  pythonpath: Sequence[Path] = (BYOM,), env: dict[str, str] | None = None) -> Run:
    """:func:`start_deepspeed`, then :meth:`Job.result`."""
    return start_deepspeed(script, script_args, workdir, nproc, pythonpath, env).result(timeout)


def run_ds_recycle(script: Path, script_args: Sequence[str], workdir: Path, timeout: float, nproc: int = 4,
                   launcher_args: Sequence[str] = (), pythonpath: Sequence[Path] = (BYOM,),
                   env: dict[str, str] | None = None) -> Run:
    """:func:`start_ds_recycle`, then :meth:`Job.result`."""
    return start_ds_recycle(script, script_args, workdir, nproc, launcher_args, pythonpath, env).result(timeout)


VanillaRuns = Callable[..., Run]
"""The ``vanilla`` fixture: ``vanilla(model, launcher="torchrun", config="fp32", repeat=0) -> Run``."""


# ---------------------------------------------------------------------------------------------- comparing
def _load(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def identical(a: Path, b: Path) -> bool:
    """Same names, and every tensor equal bit for bit."""
    x, y = _load(a), _load(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def assert_same_final(a: Path, b: Path, rtol: float = 1e-5, atol: float = 0.0) -> None:
    """Every tensor of ``a`` within ``atol + rtol * max|b|`` of ``b``'s, same names and shapes."""
    diffs = compare_state_dicts(_load(a), _load(b), rtol, atol)
    bad = [d for d in diffs if not d.ok]
    assert diffs and not bad, "final parameters differ:\n" + "\n".join(
        f"  {d.name}: {d.problem or f'max|a-b| {d.max_abs:.3g} (relative {d.max_rel:.3g})'}" for d in bad[:20])
