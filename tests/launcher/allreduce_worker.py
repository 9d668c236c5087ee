"""A tiny gloo worker for the launcher tests: env:// init, a loop of all-reduces, optional self-inflicted failures.

    python -m ds_recycle launch --num_accelerators 4 --master_port 0 tests/launcher/allreduce_worker.py --steps 20

Options: ``--die_rank R --die_step S --die_how {sigkill,exit1,exit75,ecc,device-assert}`` makes rank R fail at
step S (in its first run only, so a restarted rank finishes; ``ecc`` and ``device-assert`` raise the CUDA errors
torch raises for them); ``--hang_rank R`` makes rank R sleep forever after init (for
stop tests); ``--local_only`` skips torch.distributed entirely (each step only sleeps), so the other ranks
are unaffected by a death; ``--deepspeed`` initializes through ``deepspeed.init_distributed``. Survivors that see a
collective fail (the dead peer) print ``PEER_FAILED`` and
exit 0 with ``os._exit`` (the group references a dead peer, so a clean teardown is not possible). Every rank
prints ``READY rank=R pid=P`` after init and ``DONE rank=R sum=X`` at the end.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from datetime import timedelta


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=None)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--step_sleep", type=float, default=0.0)
    parser.add_argument("--die_rank", type=int, default=None)
    parser.add_argument("--die_step", type=int, default=0)
    parser.add_argument("--die_how", choices=["sigkill", "exit1", "exit75", "ecc", "device-assert"], default="sigkill")
    parser.add_argument("--hang_rank", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--deepspeed", action="store_true")
    parser.add_argument("--local_only", action="store_true")
    return parser.parse_args()


def _init(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    if args.deepspeed:
        import deepspeed
        import deepspeed.ops
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=args.timeout))
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))


def _die(how: str) -> None:
    sys.stdout.flush()
    if how in ("ecc", "device-assert"):  # what torch raises for these CUDA errors (this test needs no GPU)
        raise RuntimeError("CUDA error: " + ("uncorrectable ECC error encountered" if how == "ecc" else
                                             "device-side assert triggered"))
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(1 if how == "exit1" else 75)


def _local_only(args: argparse.Namespace, rank: int) -> None:
    """No process group: report, then sleep step by step (a death elsewhere cannot disturb this rank)."""
    for step in range(args.steps):
        if rank == args.die_rank and step == args.die_step and _first_run():
            _die(args.die_how)
        time.sleep(args.step_sleep)
    print(f"DONE rank={rank}", flush=True)


def _first_run() -> bool:
    return os.environ.get("DS_RECYCLE_RESTART_COUNT", "0") == "0"


def main() -> None:
    args = _parse()
    if args.local_only:
        rank = int(os.environ["RANK"])
        print(f"READY rank={rank} pid={os.getpid()} restart={os.environ.get('DS_RECYCLE_RESTART_COUNT')}",
              flush=True)
        if rank == args.hang_rank:
            time.sleep(3600)
        _local_only(args, rank)
        return
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    _init(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"READY rank={rank} pid={os.getpid()} world={world} local_rank_arg={args.local_rank} "
          f"restart={os.environ.get('DS_RECYCLE_RESTART_COUNT')} omp={os.environ.get('OMP_NUM_THREADS')}", flush=True)
    if rank == args.hang_rank:
        time.sleep(3600)
    total = torch.zeros(1)
    for step in range(args.steps):
        if rank == args.die_rank and step == args.die_step and _first_run():
            _die(args.die_how)
        t = torch.ones(1) * (rank + 1)
        try:
            dist.all_reduce(t)
        except RuntimeError as err:
            print(f"PEER_FAILED rank={rank} step={step}: {str(err).splitlines()[0]}", flush=True)
            os._exit(0)
        total += t
        time.sleep(args.step_sleep)
    print(f"DONE rank={rank} sum={total.item():.0f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
