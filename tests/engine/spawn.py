"""Start the processes of a small gloo job from a test: bounded in time, none left behind."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SITE = REPO / "tests" / "site"
"""The tests' site hook (``tests/site/sitecustomize.py``): no shared-memory op build, no module teardown."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(nproc: int, args: Sequence[str], timeout: float = 180.0) -> list[str]:
    """Run ``python <args>`` as ranks 0..nproc-1; returns each rank's output; raises on failure or timeout."""
    port = free_port()
    procs = []
    for rank in range(nproc):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONPATH": os.pathsep.join((str(SITE), str(REPO))),
               "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled"}
        procs.append(subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    deadline = time.monotonic() + timeout
    outs: list[str] = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append(out)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"job timed out after {timeout} s: {' '.join(args)}") from None
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if bad:
        raise AssertionError(f"ranks failed {bad}:\n" + "\n".join(o[-3000:] for o in outs))
    return outs
