"""What the canonical order of the gradient reduction costs: one stage's reduction, ring order against canonical.

    PYTHONPATH=$PWD python benchmarks/reduction_order.py --pipelines 3 4 --reps 30

For D > 2 pipelines the stage's replicas all-reduce a ``[D, N]`` table of per-owner-pipeline gradient rows and
add the rows in pipeline order (``StaggeredOptimizer(canonical_order=True)``, the default), so that the sum
is the same floating-point number whoever is alive; the cheaper ring order all-reduces the ``N`` gradient
values once, in an order that depends on the group (``canonical_order=False``). This script starts D gloo
processes on this machine, gives each the parameters of stage 0 of the default GPT
(``configs/gpt_cpu_2x2.json``: embedding and the first half of the blocks, as many parameters as that stage
holds) with random gradients, and times :meth:`StaggeredOptimizer.reduce` in the ring order, the canonical order
of a failure-free run (reduce-scatter, then all-gather) and the canonical order after a failure (the whole
table all-reduced), alternated, ``reps`` times each (medians; one compute thread per process, as under
``ds-recycle launch``). The iteration time of
the default job with D pipelines, measured separately, puts the difference in proportion (see
``benchmarks/results/reduction-order-*.txt``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ds_recycle.config import load_config  # noqa: E402
from ds_recycle.engine.optimizer import StaggeredOptimizer  # noqa: E402
from ds_recycle.engine.transport import DistTransport  # noqa: E402
from ds_recycle.model.gpt import gpt_layer_specs  # noqa: E402

CONFIG = REPO / "configs" / "gpt_cpu_2x2.json"


def stage0_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of the default GPT's first stage (embedding and the first half of the blocks)."""
    specs = gpt_layer_specs(load_config(CONFIG).recycle.model)
    first = specs[: 1 + (len(specs) - 2) // 2]
    return [tuple(p.shape) for spec in first for p in spec.build().parameters()]


class _TableOnly(StaggeredOptimizer):
    """The canonical order through the whole-table all-reduce (the path taken after a failure)."""

    def _own_row_only(self) -> bool:
        return False


MODES = {"ring": (StaggeredOptimizer, False), "canonical": (StaggeredOptimizer, True), "table": (_TableOnly, True)}


def _worker(rank: int, world: int, store_path: str, shapes: list[tuple[int, ...]], reps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    params = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in shapes])
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for rep in range(len(MODES) * (reps + 1)):
        mode = list(MODES)[rep % len(MODES)]
        cls, canonical = MODES[mode]
        stepper = cls(params, torch.optim.SGD(params.parameters(), lr=0.0), stage=0, pipelines=world,
                      transport=DistTransport(), dp_ranks=list(range(world)), max_norm=0.0, served=frozenset({rank}),
                      canonical_order=canonical, microbatches=4)
        gen = torch.Generator().manual_seed(rep * 100 + rank)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        dist.barrier()
        t0 = time.perf_counter()
        stepper.reduce(None)
        dt = time.perf_counter() - t0
        if rep >= len(MODES):  # the first round of each warms gloo's buffers up
            times[mode].append(dt)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def measure(pipelines: int, shapes: list[tuple[int, ...]], reps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.spawn(_worker, args=(pipelines, os.path.join(tmp, "store"), shapes, reps, out), nprocs=pipelines)
        times = json.loads(Path(out).read_text())
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pipelines", type=int, nargs="+", default=[3, 4])
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    shapes = stage0_shapes()
    numel = sum(torch.Size(s).numel() for s in shapes)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}, torch {torch.__version__}, gloo")
    print(f"# command: PYTHONPATH=$PWD python benchmarks/reduction_order.py --pipelines "
          f"{' '.join(map(str, args.pipelines))} --reps {args.reps}")
    print(f"# stage 0 of {CONFIG.name}: {numel} parameters ({numel * 4 / 2**20:.1f} MiB of fp32 gradients)")
    print("# ring: all-reduce of the replicas' sums (not exact for D > 2); canonical: reduce-scatter + all-gather "
          "(failure-free runs); table: the whole-table all-reduce (after a failure)")
    print(f"{'D':>3} {'ring ms':>9} {'canonical ms':>13} {'ratio':>6} {'table ms':>9} {'ratio':>6}")
    for d in args.pipelines:
        t = measure(d, shapes, args.reps)
        print(f"{d:>3} {t['ring'] * 1e3:>9.1f} {t['canonical'] * 1e3:>13.1f} {t['canonical'] / t['ring']:>6.2f} "
              f"{t['table'] * 1e3:>9.1f} {t['table'] / t['ring']:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
