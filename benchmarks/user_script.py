"""A user's DeepSpeed pipeline script, stock and with the two-line ds_recycle change: time per iteration side by side.

    .venv/bin/python benchmarks/user_script.py                        # alexnet, 40 steps, 3 alternated rounds
    .venv/bin/python benchmarks/user_script.py --model gpt --rounds 5

Runs ``tests/byom/user_train.py`` (4 processes, 2 stages x 2 pipelines, real compute on CPU) as

- ``vanilla``: stock DeepSpeed under torchrun;
- ``recycle-torchrun``: the ds_recycle variant under torchrun (the ReCycle engine, no failure handling);
- ``recycle-launch``: the variant under ``ds-recycle launch`` (failure handling on);

alternated round by round, and reports the median time per iteration (the time between consecutive
``step N loss`` lines, steps 5 onwards) and the ratios to vanilla, with the machine's load. Every worker
shares the same cores, so the ratios measure per-iteration overhead, not what a pipeline gains on accelerators.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.byom.harness import (  # noqa: E402
    USER_TRAIN,
    Job,
    script_args,
    start_ds_recycle,
    start_torchrun,
    write_recycle_variant,
)

WARMUP = 5


def _iteration_times(job: Job, steps: int, timeout_s: float) -> list[float]:
    stamps = []
    for step in range(steps):
        job.wait_for(rf"step {step} loss", timeout=timeout_s)
        stamps.append(time.monotonic())
    return [b - a for a, b in zip(stamps[WARMUP:], stamps[WARMUP + 1:])]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="alexnet", choices=("alexnet", "gpt", "tuple", "mlp", "vit", "fuzzed"))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        variant = write_recycle_variant(USER_TRAIN, work / "variant")
        starts = {"vanilla": lambda d: start_torchrun(USER_TRAIN, script_args(args.model, steps=args.steps), d),
                  "recycle-torchrun": lambda d: start_torchrun(variant, script_args(args.model, steps=args.steps), d),
                  "recycle-launch": lambda d: start_ds_recycle(variant, script_args(args.model, steps=args.steps), d)}
        times: dict[str, list[float]] = {name: [] for name in starts}
        loads = []
        for r in range(args.rounds):
            for name, start in starts.items():
                with start(work / f"{name}-{r}") as job:
                    times[name] += _iteration_times(job, args.steps, 300.0)
                    job.result(300.0).check()
                loads.append(os.getloadavg()[0])
    base = statistics.median(times["vanilla"])
    import deepspeed
    import torch

    print(f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}, "
          f"deepspeed {deepspeed.__version__}")
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores; load average during the runs "
          f"{min(loads):.1f}-{max(loads):.1f}")
    print(f"command: {' '.join(['python', *sys.argv])}")
    print(f"model {args.model}, 2 stages x 2 pipelines, {args.steps} steps, {args.rounds} alternated rounds, "
          f"real compute on CPU (not emulated)")
    print(f"{'variant':<18}{'median s/iter':>14}{'vs vanilla':>12}{'iterations':>12}")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"{name:<18}{med:>14.4f}{med / base:>12.3f}{len(values):>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
