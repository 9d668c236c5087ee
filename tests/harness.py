"""Run `ds-recycle launch` jobs from tests: bounded in time, never leaving a process behind."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_recycle.tools.procs import dump_stacks

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Job:
    returncode: int
    output: str

    def metrics(self, path: Path) -> list[dict[str, Any]]:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def launch(nproc: int, script_args: Sequence[str], timeout: float = 240.0,
           launcher_args: Sequence[str] = (), env: dict[str, str] | None = None) -> Job:
    """``ds-recycle launch --num_accelerators nproc launch/train.py <script_args>`` in its own session."""
    cmd = [sys.executable, "-m", "ds_recycle", "launch", "--num_accelerators", str(nproc), "--master_port", "0",
           *launcher_args, str(REPO / "launch" / "train.py"), *script_args]
    return run(cmd, timeout, env)


def run(cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> Job:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled", **(env or {})}
    proc = subprocess.Popen(list(cmd), cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        if dump_stacks(proc.pid):  # every thread's stack of every worker into the output, to see where it hangs
            time.sleep(2.0)
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"job timed out after {timeout} s: {' '.join(cmd)}\n{hang_report(out)}") from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing of the job may outlive the test
        except ProcessLookupError:
            pass
    return Job(proc.returncode, out)


def _report(output: str, title: str, line: str, tail: int) -> str:
    """A job's output for a failure message: its lines that match ``line`` (any worker's ``[rank N]`` prefixes
    allowed) under ``title``, then the output's tail."""
    picked = [text for text in output.splitlines() if re.match(rf"(\[rank \d+\] )*({line})", text)]
    return (f"{title}:\n" + "\n".join(picked) + "\n\n" if picked else "") + "last output:\n" + output[-tail:]


def hang_report(output: str, tail: int = 5000) -> str:
    """A timed-out job's output for its failure message: the workers' stack dumps (SIGUSR1, :func:`dump_stacks`),
    then the output's tail."""
    return _report(output, "stacks of the workers at the timeout",
                   r"Thread 0x|Current thread 0x|  File |Stack \(most recent", tail)


def failure_report(output: str, tail: int = 5000) -> str:
    """A failed job's output for its failure message: every traceback line of every worker, then the output's tail."""
    return _report(output, "tracebacks", r"Traceback|  File |\w+(Error|Exception|Failure)\b", tail)


def tiny_config(tmp: Path, name: str, stages: int, pipelines: int = 2, **recycle: Any) -> Path:
    """A small GPT job config (seq 32, width 64, one block a stage, Adam, clipping on) written to ``tmp``.

    ``recycle`` overrides or adds keys of the ``"recycle"`` section; ``None`` values are left out.
    """
    section: dict[str, Any] = {"enabled": True, "stages": stages, "pipelines": pipelines, "schedule": "adaptive",
                               "optimizer_step": "staggered",
                               "model": {"vocab_size": 256, "seq_len": 32, "n_layer": stages, "d_model": 64,
                                         "n_head": 4}}
    section.update({k: v for k, v in recycle.items() if v is not None})
    path = tmp / f"{name}.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
                                "gradient_clipping": 1.0, "optimizer": {"type": "Adam", "params": {"lr": 3e-3}},
                                "recycle": section}))
    return path


def assert_same_model(a: Path, b: Path, atol: float = 0.0, rtol: float = 0.0) -> None:
    """The two final-parameter files hold the same model, bit for bit unless ``rtol``/``atol`` say otherwise (what
    ``ds-recycle compare a b --rtol 0`` calls a MATCH), checked in this process (``tests/foundation/test_compare.py``
    runs the command itself)."""
    import torch

    from ds_recycle.tools.compare import compare_state_dicts

    diffs = compare_state_dicts(torch.load(a, weights_only=True), torch.load(b, weights_only=True), rtol, atol)
    bad = [d for d in diffs if not d.ok]
    assert diffs and not bad, "models differ: " + "; ".join(
        f"{d.name} max abs {d.max_abs:.3e} rel {d.max_rel:.3e} {d.problem}" for d in bad[:5])


class QuietDetector:
    """A failure detector (:class:`ds_recycle.resilience.comm.Detector`) that never finds a failure: for groups and
    waits tested without a watchdog, where only a broken group or a dead pair may end a wait."""

    def failed(self) -> bool:
        return False

    def tripped(self) -> bool:
        return False

    def reason(self) -> str:
        return ""
