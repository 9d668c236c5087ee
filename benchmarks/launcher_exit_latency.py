"""How fast does the store learn of a worker's death? Time from SIGKILL to ``ds_recycle/exit/<rank>``.

    PYTHONPATH=$PWD python benchmarks/launcher_exit_latency.py --trials 5

Each trial starts ``ds-recycle launch`` with 2 workers that only sleep (tests/launcher/allreduce_worker.py
--local_only), connects to its store as a client, SIGKILLs rank 1, and spins on ``store.check`` until the
launcher has written the exit key. Side by side, the same loop watches the victim with psutil: the moment
any observer could see the death. Prints both medians and their ratio (the launcher's own delay).
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import psutil
from torch.distributed import TCPStore

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "launcher" / "allreduce_worker.py"


def _read_until(proc: subprocess.Popen[bytes], pattern: str, count: int, timeout_s: float = 60) -> list[re.Match[bytes]]:
    assert proc.stdout is not None
    found: list[re.Match[bytes]] = []
    deadline = time.monotonic() + timeout_s
    while len(found) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {pattern!r} within {timeout_s} s")
        m = re.search(pattern.encode(), proc.stdout.readline())
        if m:
            found.append(m)
    return found


def _gone(proc: psutil.Process) -> bool:
    """Dead: a zombie waiting to be reaped, or already reaped."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def trial() -> tuple[float, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "ds_recycle", "launch", "--num_accelerators", "2", "--master_port",
                             "0", str(WORKER), "--local_only", "--steps", "600", "--step_sleep", "0.1"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        port = int(_read_until(proc, r"store at [\d.]+:(\d+)", 1)[0][1])
        pids = {int(m[1]): int(m[2]) for m in _read_until(proc, r"READY rank=(\d) pid=(\d+)", 2)}
        store = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))
        victim = psutil.Process(pids[1])
        killed = time.perf_counter()
        os.kill(pids[1], signal.SIGKILL)
        seen_dead = None
        while not store.check(["ds_recycle/exit/1"]):
            if seen_dead is None and _gone(victim):
                seen_dead = time.perf_counter()
        in_store = time.perf_counter()
        return (seen_dead or in_store) - killed, in_store - killed
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    results = [trial() for _ in range(args.trials)]
    zombie = statistics.median(r[0] for r in results) * 1e3
    store = statistics.median(r[1] for r in results) * 1e3
    print(f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print(f"trials: {args.trials}")
    print(f"kill -> process seen dead (psutil): median {zombie:.2f} ms")
    print(f"kill -> ds_recycle/exit/1 in the store: median {store:.2f} ms (max {max(r[1] for r in results) * 1e3:.2f} ms)")
    print(f"store / process-seen-dead: {store / max(zombie, 1e-6):.1f}x")


if __name__ == "__main__":
    main()
