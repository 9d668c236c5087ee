"""ReCycle against Oobleck, Bamboo, checkpoint-restart and replica dropping, on the published traces.

One command, one table (plus the anchor, the sensitivity study, the scale check and the figures):

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/simulate_paper.py           # every trace
    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/simulate_paper.py --quick   # 10m, 1h, g4dn only

The traces are read from `<repo>/../shared/traces/oobleck/` (or `--traces DIR`). The job is the
traces' 30 nodes as S=6 stages x D=5 pipelines, M=12 micro-batches per pipeline, the model's GPT-3
global batch split into micro-batches of round(batch / 60) sequences. Every modelling number and its
source is printed by `ds-recycle simulate` and lives in `ds_recycle/cluster/assumptions.py`.
Figures and this run's output go to `benchmarks/results/<date>/`.
"""
from __future__ import annotations

import argparse
import datetime
import io
import os
import platform
import sys
import time
from contextlib import redirect_stdout
from dataclasses import replace
from pathlib import Path

from ds_recycle.cluster.assumptions import Assumptions, resolve_assumptions
from ds_recycle.cluster.draw import draw_frequency, draw_timeline
from ds_recycle.cluster.generator import generate_trace
from ds_recycle.cluster.models import get_model
from ds_recycle.cluster.simulator import SimulationResult, default_hours, job_mtbf_s, simulate
from ds_recycle.cluster.systems import SystemKind
from ds_recycle.cluster.timing import BaselineSchedule, JobShape, PipelineTimer
from ds_recycle.cluster.trace import Trace, read_trace
from ds_recycle.cluster.workload import Workload, workload_from_model

REPO = Path(__file__).resolve().parents[1]
MODELS = ("gpt3-medium", "gpt3-2.7b", "gpt3-6.7b")
SYNTHETIC = ("5m", "10m", "30m", "1h", "3h", "6h")
ALL_TRACES = SYNTHETIC + ("g4dn-trace",)
SHAPE = JobShape(stages=6, pipelines=5, microbatches=12)
OTHERS = (SystemKind.OOBLECK, SystemKind.BAMBOO, SystemKind.CHECKPOINT, SystemKind.DROP,
          SystemKind.RECOVER)
PAPER = {SystemKind.OOBLECK: "1.46 (ReCycle)", SystemKind.BAMBOO: "1.64 (ReCycle)",
         SystemKind.CHECKPOINT: "2.23 (ReCoVer)"}
PERIOD_H = {"5m": 5 / 60, "10m": 10 / 60, "30m": 0.5, "1h": 1.0, "3h": 3.0, "6h": 6.0}


def _workload(model: str) -> Workload:
    m = get_model(model)
    return workload_from_model(m, max(1, round(m.global_batch / (SHAPE.pipelines * SHAPE.microbatches))))


def _run(trace: Trace, w: Workload, timer: PipelineTimer, a: Assumptions,
         kinds: tuple[SystemKind, ...] = (SystemKind.RECYCLE,) + OTHERS) -> SimulationResult:
    return simulate(trace, w, SHAPE, kinds, hours=default_hours(trace), assumptions=a, timer=timer)


def _assumptions(trace: Trace, w: Workload) -> Assumptions:
    return resolve_assumptions(w, SHAPE, job_mtbf_s(trace, default_hours(trace) * 3600))


def main_table(traces: dict[str, Trace], out: Path) -> dict[tuple[str, str], SimulationResult]:
    print("== ReCycle's effective throughput over each system's (ratio > 1: ReCycle ahead) ==")
    print("   rebal: ReCycle moving live nodes between stages (beyond the paper) over Oobleck;")
    print("   zb:    the other systems running the zero-bubble ZB-H1 schedule too, ReCycle over Oobleck")
    head = f"{'model':<12}{'trace':<11}{'ReCycle/s':>10}" + "".join(f"{k.value:>11}" for k in OTHERS) \
        + f"{'rebal':>8}{'zb':>7}{'s':>6}"
    print(head)
    results: dict[tuple[str, str], SimulationResult] = {}
    for model in MODELS:
        w = _workload(model)
        timer = PipelineTimer(w, SHAPE)
        zb_timer = timer.with_baseline(BaselineSchedule.ZB_H1)
        for name, trace in traces.items():
            t0 = time.perf_counter()
            a = _assumptions(trace, w)
            r = _run(trace, w, timer, a)
            rebal = _run(trace, w, timer, replace(a, recycle_rebalance=True),
                         (SystemKind.RECYCLE, SystemKind.OOBLECK))
            zb = _run(trace, w, zb_timer, a, (SystemKind.RECYCLE, SystemKind.OOBLECK))
            results[(model, name)] = r
            rec = r.systems[SystemKind.RECYCLE].effective_rate
            print(f"{model:<12}{name:<11}{rec:>10.1f}"
                  + "".join(f"{r.ratio(k):>10.2f}x" for k in OTHERS)
                  + f"{rebal.ratio(SystemKind.OOBLECK):>7.2f}x{zb.ratio(SystemKind.OOBLECK):>6.2f}x"
                  + f"{time.perf_counter() - t0:>6.1f}")
    print("\nbest ratio over all models and traces, against the published figure:")
    for k in OTHERS:
        ratios = [r.ratio(k) for r in results.values()]
        print(f"  ReCycle / {k.value:<10}: up to {max(ratios):.2f}x, median {sorted(ratios)[len(ratios) // 2]:.2f}x"
              f"  (paper: {PAPER.get(k, '-')})")
    return results


def anchor(results: dict[tuple[str, str], SimulationResult]) -> None:
    print("\n== Anchor: effective-time fraction, one failure every 10 minutes ==")
    print("   Oobleck's simulator, BERT-large: Bamboo 0.150, Varuna 0.544, Oobleck 0.955")
    print(f"   {'model':<12}{'bamboo':>8}{'checkpt':>9}{'oobleck':>9}{'recycle':>9}")
    for model in MODELS:
        r = results.get((model, "10m"))
        if r is None:
            continue
        f = {k: r.systems[k].effective_fraction for k in r.systems}
        print(f"   {model:<12}{f[SystemKind.BAMBOO]:>8.3f}{f[SystemKind.CHECKPOINT]:>9.3f}"
              f"{f[SystemKind.OOBLECK]:>9.3f}{f[SystemKind.RECYCLE]:>9.3f}")


def sensitivity(traces: dict[str, Trace]) -> None:
    print("\n== Sensitivity of the ranking (gpt3-2.7b) to the three most uncertain parameters ==")
    print("   ranking by effective throughput, best first; ratio = ReCycle over the best other system")
    w = _workload("gpt3-2.7b")
    timer = PipelineTimer(w, SHAPE)
    knobs = {
        "restart x0.5": lambda a: replace(a, restart_s=a.restart_s * 0.5),
        "restart x2": lambda a: replace(a, restart_s=a.restart_s * 2),
        "bamboo RC 10%": lambda a: replace(a, bamboo_overhead=0.10),
        "bamboo RC 30%": lambda a: replace(a, bamboo_overhead=0.30),
        "reconfig x0.5": lambda a: replace(a, reconfigure_s=a.reconfigure_s * 0.5,
                                           oobleck_reconfigure_s=a.oobleck_reconfigure_s * 0.5,
                                           bamboo_reconfigure_s=a.bamboo_reconfigure_s * 0.5),
        "reconfig x4": lambda a: replace(a, reconfigure_s=a.reconfigure_s * 4,
                                         oobleck_reconfigure_s=a.oobleck_reconfigure_s * 4,
                                         bamboo_reconfigure_s=a.bamboo_reconfigure_s * 4),
    }
    for name in [n for n in ("10m", "1h", "g4dn-trace") if n in traces]:
        trace = traces[name]
        base = _assumptions(trace, w)
        for label, change in [("default", lambda a: a)] + list(knobs.items()):
            r = _run(trace, w, timer, change(base))
            order = sorted(r.systems, key=lambda k: -r.systems[k].effective_rate)
            best_other = max((k for k in r.systems if k is not SystemKind.RECYCLE),
                             key=lambda k: r.systems[k].effective_rate)
            print(f"   {name:<11}{label:<15}{' > '.join(k.value for k in order):<60}"
                  f"{r.ratio(best_other):.2f}x over {best_other.value}")


def scale_check() -> None:
    print("\n== Scale: 24 h on 4,096 GPUs (512 nodes x 8), gpt3-6.7b, S=8 x D=64, M=16 ==")
    trace = generate_trace(nodes=512, hours=24.0, mtbf_hours=1.0, seed=0, repair_hours=2.0)
    shape = JobShape(8, 64, 16)
    m = get_model("gpt3-6.7b")
    w = workload_from_model(m, max(1, round(m.global_batch / (64 * 16))))
    t0 = time.perf_counter()
    r = simulate(trace, w, shape, (SystemKind.RECYCLE,) + OTHERS, hours=24.0)
    wall = time.perf_counter() - t0
    print(f"   {trace.removals} failures (MTBF 1 h, repairs 2 h), 6 systems simulated in {wall:.2f} s "
          f"(target < 10 s); planner: {int(r.planner['recycle_plans'])} ReCycle plans in "
          f"{r.planner['recycle_plan_s']:.2f} s, {int(r.planner['recycle_lookups'])} lookups")
    print("   " + ", ".join(f"{k.value} {v.effective_rate:.0f}/s" for k, v in r.systems.items()))


def figures(results: dict[tuple[str, str], SimulationResult], out: Path) -> None:
    for model in MODELS:
        points: dict[SystemKind, list[tuple[float, float]]] = {}
        for name in SYNTHETIC:
            r = results.get((model, name))
            if r is None:
                continue
            for k, v in r.systems.items():
                points.setdefault(k, []).append((1.0 / PERIOD_H[name], v.effective_rate))
        if points:
            draw_frequency(points, f"{model}: throughput vs failure frequency", out / f"frequency_{model}.png")
    for name in ("1h", "g4dn-trace"):
        r = results.get(("gpt3-2.7b", name))
        if r is not None:
            draw_timeline(r, out / f"timeline_gpt3-2.7b_{name}.png")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", default=str(REPO.parent / "shared" / "traces" / "oobleck"))
    parser.add_argument("--quick", action="store_true", help="only the 10m, 1h and g4dn traces")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"
                                             / datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")))
    args = parser.parse_args()
    folder = Path(args.traces)
    if not folder.is_dir():
        print(f"error: the traces folder {folder} does not exist. Fix: pass --traces DIR (the repository's "
              "parent should hold shared/traces/oobleck/)", file=sys.stderr)
        return 2
    names = ("10m", "1h", "g4dn-trace") if args.quick else ALL_TRACES
    traces = {n: read_trace(folder / f"{n}.csv") for n in names}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    buffer = io.StringIO()

    class Tee(io.TextIOBase):
        def write(self, s: str) -> int:
            sys.__stdout__.write(s)
            sys.__stdout__.flush()
            return buffer.write(s)

    with redirect_stdout(Tee()):
        print(f"# ds-recycle simulate_paper, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
        print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cpus, Python "
              f"{platform.python_version()}; command: PYTHONPATH=. python benchmarks/simulate_paper.py"
              f"{' --quick' if args.quick else ''}")
        print(f"job: {SHAPE.stages} stages x {SHAPE.pipelines} pipelines (the traces' 30 nodes), "
              f"M={SHAPE.microbatches}; every system checkpoints at Young's interval\n")
        t0 = time.perf_counter()
        results = main_table(traces, out)
        anchor(results)
        sensitivity(traces)
        scale_check()
        figures(results, out)
        print(f"\nfigures in {out}; total {time.perf_counter() - t0:.0f} s")
    (out / ("simulate_paper_quick.txt" if args.quick else "simulate_paper.txt")).write_text(buffer.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
