"""ReCycle + re-partition beside ReCycle, Oobleck, Bamboo and checkpoint-restart on the published failure traces.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/simulate_repartition.py \
        --out benchmarks/results/simulate-repartition-$(date +%F).txt
    PYTHONPATH=. .venv/bin/python benchmarks/simulate_repartition.py --traces 1h --models gpt3-2.7b   # one run

The job, the traces and every modelling number are those of ``benchmarks/simulate_paper.py`` (S = 6 stages x
D = 5 pipelines, M = 12, ``ds_recycle/cluster/assumptions.py``); ``recycle-repartition`` is
:mod:`ds_recycle.cluster.systems.recycle_repartition`: the same planner on the model's per-layer costs
(:func:`ds_recycle.cluster.models.layer_costs`), moving layers once a membership has lasted 3 iterations when it
pays over 100. Prints each system's effective throughput (samples/s over the whole trace) and the ratios of
ReCycle + re-partition over ReCycle and over the best other system.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.simulate_paper import ALL_TRACES, MODELS, SHAPE, _assumptions, _workload  # noqa: E402
from ds_recycle.cluster.simulator import default_hours, simulate  # noqa: E402
from ds_recycle.cluster.systems import SystemKind  # noqa: E402
from ds_recycle.cluster.timing import PipelineTimer  # noqa: E402
from ds_recycle.cluster.trace import read_trace  # noqa: E402

KINDS = (SystemKind.RECYCLE_REPARTITION, SystemKind.RECYCLE, SystemKind.OOBLECK, SystemKind.BAMBOO,
         SystemKind.CHECKPOINT)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", default="10m,1h,6h,g4dn-trace", help=f"comma-separated, from {', '.join(ALL_TRACES)}")
    p.add_argument("--models", default="gpt3-2.7b", help=f"comma-separated, from {', '.join(MODELS)}")
    p.add_argument("--traces-dir", default=str(REPO.parent / "shared" / "traces" / "oobleck"))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    lines = [f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; machine: {platform.node()}",
             f"command: .venv/bin/python benchmarks/simulate_repartition.py {' '.join(sys.argv[1:])}",
             f"job: {SHAPE.stages} stages x {SHAPE.pipelines} pipelines, M = {SHAPE.microbatches}; effective "
             f"samples/s over each trace (simulated, planner-timed)",
             f"{'model':<12}{'trace':<12}" + "".join(f"{k.value:>21}" for k in KINDS)
             + f"{'repart/recycle':>16}{'repart/best other':>19}{'moves':>7}{'sim s':>7}"]
    print("\n".join(lines), flush=True)
    for model in args.models.split(","):
        w = _workload(model)
        timer = PipelineTimer(w, SHAPE)
        for name in args.traces.split(","):
            trace = read_trace(Path(args.traces_dir) / f"{name}.csv")
            t0 = time.perf_counter()
            r = simulate(trace, w, SHAPE, KINDS, hours=default_hours(trace), assumptions=_assumptions(trace, w),
                         timer=timer)
            rate = {k: v.effective_rate for k, v in r.systems.items()}
            mine = rate[SystemKind.RECYCLE_REPARTITION]
            best_other = max((k for k in KINDS if k not in (SystemKind.RECYCLE_REPARTITION, SystemKind.RECYCLE)),
                             key=rate.__getitem__)
            moves = sum(1 for _, text in r.systems[SystemKind.RECYCLE_REPARTITION].notes if "re-partition" in text)
            line = (f"{model:<12}{name:<12}" + "".join(f"{rate[k]:>21.1f}" for k in KINDS)
                    + f"{mine / rate[SystemKind.RECYCLE]:>15.3f}x{mine / rate[best_other]:>12.3f}x "
                    f"{best_other.value:<6}{moves:>5}{time.perf_counter() - t0:>7.0f}")
            lines.append(line)
            print(line, flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
