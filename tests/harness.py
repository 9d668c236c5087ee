"""Run `ds-recycle launch` jobs from tests: bounded in time, never leaving a process behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

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
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"job timed out after {timeout} s: {' '.join(cmd)}\n{out[-4000:]}") from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing of the job may outlive the test
        except ProcessLookupError:
            pass
    return Job(proc.returncode, out)
