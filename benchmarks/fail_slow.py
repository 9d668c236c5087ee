"""Fail-slow on emulated accelerators: one worker runs slower from an iteration on; each system against its own
failure-free run.

    .venv/bin/python benchmarks/fail_slow.py [--shape 4x4] [--microbatches 8] [--factors 1.5,2,3] \
        [--slow-workers 1:1[,2:2]] [--from-step 4] [--steps 24] [--blocks 16] [--f-ms 100] [--rounds 1] \
        [--out FILE]
    .venv/bin/python benchmarks/fail_slow.py --suite --steps 26 --only '^$' [--rounds 2] [--out FILE]

EMULATED ACCELERATORS (``benchmarks/emulated/``: F, B, W sleep the GPT-3 2.7B profile's time; a slow worker's
sleeps are ``factor`` times longer from ``--from-step`` on, :func:`benchmarks.emulated.layers.set_slowdown`). Cases
per factor, run one after the other: vanilla DeepSpeed (1F1B) failure-free and with the slow worker(s),
ds_recycle (adaptive, under ``ds-recycle launch``) failure-free, with them, and with them but its fail-slow
detection off. Reported: the median time per iteration, the slowdowns S0 (vanilla) and S1 (ds_recycle, once its
plan assumes the slow worker) against their own failure-free runs, the share of the slowdown mitigated,
(S0 - S1) / (S0 - 1), how many iterations detection took, the factors it found, and what the planner predicted.

With ``--blocks N`` the model is ``N`` emulated GPT-3 2.7B blocks a stage (``benchmarks/repartition.py``'s) and
ds_recycle may also move layers off the slow worker's stage (``recycle.repartition``, on by default): S1 is then
measured after the move, and a case with re-partitioning off shows what re-routing alone keeps.

``--suite`` runs the whole table in one command (:data:`SUITE`): 4 x 4 with one worker 2x, 1.5x and 3x slow, two
workers 2x slow in different stages, and 8 x 4, each shape's failure-free runs shared by its rows.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.emulated.profiles import profile, write_profile  # noqa: E402
from benchmarks.emulated_figure import DEFAULT_F_MS, Case, Result, Worker, f_ms_for, run_case  # noqa: E402
from benchmarks.repartition import emulated_layers  # noqa: E402
from ds_recycle.events import PlanSwitchEvent, RepartitionEvent  # noqa: E402
from ds_recycle.plan import CostModel, PlanCache, make_plan  # noqa: E402
from ds_recycle.plan.partition import LayerCosts, Partition, balanced_partition, choose_partition  # noqa: E402


def median_between(res: Result, first: int, last: int | None = None) -> float:
    """Median seconds of the steps ``first..last`` (a step's time: from the previous step's end to its end)."""
    st = res.stamps
    times = [st[k] - st[k - 1] for k in sorted(st) if k >= max(first, 1) and (last is None or k <= last)
             and k - 1 in st]
    return statistics.median(times) if times else float("nan")


def _switch_step(res: Result, after: int) -> int | None:
    """The first step run under a plan that assumes a slow worker (None: no such plan switch)."""
    its = [e.iteration for e in res.events if isinstance(e, PlanSwitchEvent) and e.slow and e.iteration is not None
           and e.iteration >= after]
    return min(its) if its else None


def _move_step(res: Result, after: int) -> int | None:
    """The iteration at which the layers moved for the slow worker (None: they did not)."""
    its = [e.iteration for e in res.events if isinstance(e, RepartitionEvent) and e.iteration >= after]
    return min(its) if its else None


SUITE: tuple[tuple[str, int, float, str, tuple[float, ...]], ...] = (
    ("4x4", 32, 200.0, "1:1", (2.0, 1.5, 3.0)),
    ("4x4", 32, 200.0, "1:1,2:2", (2.0,)),
    ("8x4", 16, 200.0, "1:1", (2.0,)),
)
"""``--suite``: (shape, blocks a stage, slowest stage's F in ms, slow workers, factors) per group of rows. Each
shape keeps the runtime's CPU share that 4 x 4 has at 32 blocks and 200 ms (16 workers, 32 blocks, 200 ms; 32
workers, 16 blocks, 200 ms): each emulated worker's sleeps then outweigh its CPU on two cores."""


@dataclass(frozen=True)
class Row:
    """One row of the table: a shape, the workers that turn slow, and by what factor."""

    shape: str
    slow_workers: tuple[Worker, ...]
    factor: float

    @property
    def name(self) -> str:
        return f"{self.shape} {'+'.join(f'{p}:{s}' for p, s in self.slow_workers)} x{self.factor:g}"


@dataclass
class Setup:
    """One shape's emulated model, planner costs and the config pieces its cases share."""

    stages: int
    pipelines: int
    blocks: int
    f_ms: float
    pfile: Path
    costs: CostModel
    model: tuple[str, ...] = ()
    moving: str = ""
    stay: str = ""
    layers: LayerCosts | None = None
    base: Partition | None = None


def _shape(spec: str) -> tuple[int, int]:
    try:
        stages, pipelines = (int(x) for x in spec.lower().split("x"))
    except ValueError:
        raise SystemExit(f"shape {spec!r}: give stages x pipelines, such as 4x4") from None
    return stages, pipelines


def _workers(spec: str, stages: int, pipelines: int) -> tuple[Worker, ...]:
    try:
        return tuple((int(a) % pipelines, int(b) % stages) for a, b in (w.split(":") for w in spec.split(",")))
    except ValueError:
        raise SystemExit(f"--slow-workers {spec!r}: give comma-separated pipeline:stage pairs, such as 1:1,2:2") \
            from None


def setup(shape: str, blocks: int, f_ms: float, work: Path) -> Setup:
    """An ``S x D`` shape's model: ``blocks`` emulated blocks a stage whose layers can move (0: one emulated layer
    a stage, the profile's), the slowest stage's F ``f_ms``; its files are written under ``work``."""
    stages, pipelines = _shape(shape)
    if not blocks:
        pfile = write_profile(work / f"profile-{shape}.json", profile("gpt3-2.7b", stages, pipelines, f_ms))
        return Setup(stages, pipelines, 0, f_ms, pfile, CostModel.from_file(pfile))
    layers = emulated_layers(stages, blocks, f_ms, 3 * 4 * 8.0)
    base = balanced_partition(layers, stages, [pipelines] * stages)
    spec = work / f"layers-{shape}.json"
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps({**layers.to_json(), "parts": list(base)}))
    pfile = work / f"costs-{shape}.json"
    pfile.write_text(json.dumps(layers.stage_costs(base).to_json()))
    return Setup(stages, pipelines, blocks, f_ms, pfile, CostModel.from_file(pfile), ("--layer-costs", str(spec)),
                 json.dumps({"repartition": {"layer_costs_file": str(spec)}}),
                 json.dumps({"repartition": {"enabled": False}}), layers, base)


def row_cases(row: Row, st: Setup, from_step: int, only: str | None) -> dict[str, Case]:
    """The slow cases of one row (the failure-free ones are the shape's, :func:`ff_cases`)."""
    slow = tuple((w, from_step, row.factor) for w in row.slow_workers)
    cases = {"vanilla slow": Case("vanilla slow", "vanilla", "1f1b", slow=slow, model_args=st.model),
             "recycle slow": Case("recycle slow", "recycle", slow=slow, model_args=st.model, recycle_extra=st.moving),
             "recycle no detect": Case("recycle slow, no detection", "recycle", slow=slow, fail_slow=False,
                                       model_args=st.model, recycle_extra=st.stay)}
    if st.blocks:
        cases["recycle no move"] = Case("recycle slow, no move", "recycle", slow=slow, model_args=st.model,
                                        recycle_extra=st.stay)
    if only is not None:
        cases = {k: c for k, c in cases.items() if k in ("vanilla slow", "recycle slow") or re.search(only, k)}
    return cases


def ff_cases(st: Setup, workers: tuple[Worker, ...], from_step: int) -> dict[str, Case]:
    """A shape's failure-free runs: the slow workers' hooks in place with factor 1 (the same code runs)."""
    ff = tuple((w, from_step, 1.0) for w in workers)
    return {"vanilla ff": Case("vanilla", "vanilla", "1f1b", slow=ff, model_args=st.model),
            "recycle ff": Case("recycle", "recycle", slow=ff, model_args=st.model, recycle_extra=st.moving)}


def planned_for(st: Setup, microbatches: int, assumed: tuple[tuple[int, int, float], ...]) -> tuple[float, float]:
    """The planner's iteration time with the factors detection assumed (with blocks: on the partition it moves to)
    and its failure-free one, in the costs' unit (ms)."""
    found_slow = {(p_, s_): f for p_, s_, f in assumed}
    ff = PlanCache(st.stages, st.pipelines, microbatches, st.costs).time_per_iteration([])
    if st.layers is not None and st.base is not None:
        choice = choose_partition(st.layers, st.stages, st.pipelines, microbatches, [], st.base, slow=found_slow)
        return choice.moved_iteration_s, ff
    return make_plan(st.stages, st.pipelines, microbatches, st.costs.with_slow(found_slow)).makespan, ff


def row_line(row: Row, st: Setup, res: dict[str, Result], from_step: int,
             planned_ms: tuple[float, float] | None) -> tuple[str, float]:
    """The table's line for a row, and its share mitigated. ``planned_ms``: :func:`planned_for`'s (slow, failure-free)
    plan times; 'planned' is their ratio, 'plan+rt' the same with the runtime's measured time per iteration beyond
    the failure-free plan (the failure-free run's time minus the plan's) added to both: the runtime's work at
    iteration boundaries is not slowed by a slow worker's factor."""
    first = from_step + 1
    van_ff, van_slow = median_between(res["vanilla ff"], first), median_between(res["vanilla slow"], first)
    rec_ff = median_between(res["recycle ff"], first)
    switched = _switch_step(res["recycle slow"], from_step)
    found = median_between(res["recycle slow"], switched + 1) if switched is not None else float("nan")
    moved = _move_step(res["recycle slow"], from_step) if st.blocks else None
    if moved is not None:
        found = median_between(res["recycle slow"], moved + 1)
    no_move = float("nan")
    if "recycle no move" in res:
        switched_nm = _switch_step(res["recycle no move"], from_step)
        if switched_nm is not None:
            no_move = median_between(res["recycle no move"], switched_nm + 1) / rec_ff
    every = median_between(res["recycle slow"], first)
    no_detect = median_between(res["recycle no detect"], first) if "recycle no detect" in res else float("nan")
    s0, s1 = van_slow / van_ff, found / rec_ff
    mitigated = (s0 - s1) / (s0 - 1) if s0 > 1 else float("nan")
    assumed = _assumed(res["recycle slow"])
    factors = ",".join(f"{f:g}" for _, _, f in assumed) if assumed else "-"
    planned = with_runtime = float("nan")
    if planned_ms is not None:
        slow_s, ff_s = planned_ms[0] / 1000, planned_ms[1] / 1000
        planned, with_runtime = slow_s / ff_s, (slow_s + rec_ff - ff_s) / rec_ff
    line = (f"{row.name:>16} {van_ff:>7.3f} {van_slow:>8.3f} {s0:>6.3f} {rec_ff:>7.3f} {found:>7.3f} {s1:>6.3f} "
            f"{every / rec_ff:>6.3f} {no_detect / rec_ff:>8.3f} {'-' if switched is None else switched - from_step:>8} "
            f"{'-' if moved is None else moved - from_step:>8} {no_move:>7.3f} {factors:>12} {planned:>7.3f} "
            f"{with_runtime:>7.3f} {mitigated:>9.3f}")
    return line, mitigated


def _assumed(res: Result) -> tuple[tuple[int, int, float], ...]:
    """The slow workers and factors of the first plan switch that assumed any (empty: none)."""
    assumed = [e.slow for e in res.events if isinstance(e, PlanSwitchEvent) and e.slow]
    return tuple(assumed[0]) if assumed else ()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", action="store_true",
                   help="the whole table (SUITE: 4 x 4 at factors 2, 1.5 and 3, two slow workers, 8 x 4), each "
                        "shape at its own --blocks and --f-ms; --shape, --factors, --slow-workers, --blocks and "
                        "--f-ms then do not apply")
    p.add_argument("--shape", default="4x4")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--factors", default="2", help="comma-separated slowdown factors")
    p.add_argument("--slow-workers", default="1:1", help="comma-separated P:S of the workers that turn slow")
    p.add_argument("--from-step", type=int, default=4)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--blocks", type=int, default=0,
                   help="emulated blocks a stage (layers can move); 0: one emulated layer a stage (they cannot)")
    p.add_argument("--only", default=None,
                   help="regex: run only the cases whose name matches (besides vanilla and recycle ff and slow, "
                        "which every row needs); the others' columns read nan")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every case this many times, in alternating order: a row per round and the spread")
    p.add_argument("--f-ms", default=DEFAULT_F_MS,
                   help="emulated F of the slowest stage, ms: one number, or SxD=ms pairs (as emulated_figure.py); "
                        "with more --blocks, a longer F keeps each block's sleep, hence the runtime's CPU share, "
                        "as it is")
    p.add_argument("--workdir", default=str(REPO / "runs" / "fail-slow"))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    work = Path(args.workdir).resolve()
    if args.suite:
        groups = list(SUITE)
    else:
        stages, pipelines = _shape(args.shape)
        groups = [(args.shape, args.blocks, f_ms_for(args.f_ms, stages, pipelines), args.slow_workers,
                   tuple(float(f) for f in args.factors.split(",")))]
    setups: dict[str, Setup] = {}
    rows: list[Row] = []
    for shape, blocks, f_ms, slow, factors in groups:
        if shape not in setups:  # a shape's later groups share its first one's model
            setups[shape] = setup(shape, blocks, f_ms, work)
        st = setups[shape]
        workers = _workers(slow, st.stages, st.pipelines)
        rows.extend(Row(shape, workers, factor) for factor in factors)
    lines = [f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores; load at start "
             f"{os.getloadavg()[0]:.1f}",
             f"command: {' '.join(['.venv/bin/python', 'benchmarks/fail_slow.py', *sys.argv[1:]])}",
             f"EMULATED ACCELERATORS, M = {args.microbatches}, slow workers (pipeline:stage) from step "
             f"{args.from_step}, {args.steps} steps; s/iter = median step time. vanilla: DeepSpeed 1F1B, slow from "
             "that step on. ds_recycle adaptive: 'found' = the steps after the plan switch that assumes the slow "
             "worker(s), 'all' = every slow step (detection included), 'no detect' = recycle.fail_slow off; S = "
             "slow / failure-free of the same system (a shape's failure-free runs are shared by its rows in a "
             "round); mitigated = (S0 - S1) / (S0 - 1) with S1 = found (with blocks: the steps after the layers "
             "moved, 'moved at' iterations after the first slow step; 'no move' = re-partitioning off); planned = "
             "the planner's iteration time with the detected factors / without (with blocks: on the partition "
             "moved to); plan+rt = the same with the runtime's own time per iteration (failure-free run's time minus "
             "the failure-free plan's) added to both",
             *(f"model {shape}: " + (f"{st.blocks} emulated GPT-3 2.7B blocks a stage" if st.blocks
                                     else "one emulated layer a stage") + f"; the slowest stage's F sleeps {st.f_ms:g} ms"
               for shape, st in setups.items()),
             f"{'row':>16} {'van ff':>7} {'van slow':>8} {'S0':>6} {'rec ff':>7} {'found':>7} {'S1':>6} "
             f"{'S1 all':>6} {'S no det':>8} {'found at':>8} {'moved at':>8} {'no move':>7} {'factors':>12} "
             f"{'planned':>7} {'plan+rt':>7} {'mitigated':>9}"]
    print("\n".join(lines), flush=True)
    shares: dict[Row, list[float]] = {row: [] for row in rows}
    planned: dict[tuple[str, tuple[tuple[int, int, float], ...]], tuple[float, float]] = {}
    for round_ in range(args.rounds):  # the runs alternate their order round by round
        jobs: list[tuple[str, Row | None, str, Case]] = []
        for shape, st in setups.items():
            workers = tuple(sorted({w for row in rows if row.shape == shape for w in row.slow_workers}))
            jobs.extend((shape, None, name, case) for name, case in ff_cases(st, workers, args.from_step).items())
            for row in (r for r in rows if r.shape == shape):
                jobs.extend((shape, row, name, case) for name, case in
                            row_cases(row, st, args.from_step, args.only).items())
        if round_ % 2:
            jobs.reverse()
        results: dict[tuple[str, Row | None, str], Result] = {}
        for shape, owner, name, case in jobs:
            st = setups[shape]
            tag = (f"{shape}-ff" if owner is None
                   else owner.name.replace(" ", "-").replace(":", "_").replace("+", "-"))
            r = run_case(case, st.stages, st.pipelines, args.microbatches, args.steps, 2, st.pfile, st.pfile,
                         work / (f"{tag}-{name.replace(' ', '-')}" + (f"-r{round_}" if args.rounds > 1 else "")))
            if not r.ok:
                raise SystemExit(f"{name} ({tag}): {r.note}")
            results[(shape, owner, name)] = r
        for row in rows:
            st = setups[row.shape]
            res = {name: r for (shape, owner, name), r in results.items()
                   if shape == row.shape and owner in (None, row)}
            assumed = _assumed(res["recycle slow"])
            if assumed and (row.shape, assumed) not in planned:  # the same shape and factors: planned once
                planned[(row.shape, assumed)] = planned_for(st, args.microbatches, assumed)
            line, mitigated = row_line(row, st, res, args.from_step, planned.get((row.shape, assumed)))
            print(line, flush=True)
            lines.append(line)
            shares[row].append(mitigated)
    if args.rounds > 1:
        for row, got in shares.items():
            line = (f"{row.name}: mitigated over {args.rounds} rounds: median {statistics.median(got):.3f}, "
                    f"min {min(got):.3f}, max {max(got):.3f}")
            print(line, flush=True)
            lines.append(line)
    lines.append("found at: iterations from the first slow step to the first step under the plan that assumes it")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
