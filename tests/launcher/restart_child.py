"""A tiny worker for the restart-on-command tests (no torch): report, then die or wait for a file.

    python -m ds_recycle launch --num_accelerators 2 --master_port 0 tests/launcher/restart_child.py \\
        --die_rank 1 --until_file /tmp/go

Every run prints ``READY rank=R pid=P restart=N`` (N: ``DS_RECYCLE_RESTART_COUNT``). Then rank ``--die_rank``
SIGKILLs itself ``--die_after`` seconds later in its first run only; rank ``--finish_rank`` exits 0 at once;
every other run waits until ``--until_file`` exists and exits 0 (or exits 3 after ``--max_s`` seconds, so a
test that never creates the file fails instead of hanging).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=None)
    parser.add_argument("--die_rank", type=int, default=None)
    parser.add_argument("--die_after", type=float, default=0.2)
    parser.add_argument("--finish_rank", type=int, default=None)
    parser.add_argument("--until_file", type=Path, required=True)
    parser.add_argument("--max_s", type=float, default=60.0)
    return parser.parse_args()


def main() -> int:
    args = _parse()
    rank, restart = int(os.environ["RANK"]), int(os.environ["DS_RECYCLE_RESTART_COUNT"])
    print(f"READY rank={rank} pid={os.getpid()} restart={restart}", flush=True)
    if rank == args.die_rank and restart == 0:
        time.sleep(args.die_after)
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == args.finish_rank:
        return 0
    deadline = time.monotonic() + args.max_s
    while not args.until_file.exists():
        if time.monotonic() > deadline:
            print(f"rank {rank}: {args.until_file} never appeared", file=sys.stderr, flush=True)
            return 3
        time.sleep(0.05)
    print(f"DONE rank={rank} restart={restart}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
