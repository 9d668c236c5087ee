"""Fail-slow on emulated accelerators: one worker runs slower from an iteration on; each system against its own
failure-free run.

    .venv/bin/python benchmarks/fail_slow.py [--shape 4x4] [--microbatches 8] [--factors 1.5,2,3] \
        [--slow-workers 1:1[,2:2]] [--from-step 4] [--steps 24] [--blocks 16] [--f-ms 100] [--rounds 1] \
        [--out FILE]

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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.emulated.profiles import profile, write_profile  # noqa: E402
from benchmarks.emulated_figure import DEFAULT_F_MS, Case, Result, f_ms_for, run_case  # noqa: E402
from benchmarks.repartition import emulated_layers  # noqa: E402
from ds_recycle.events import PlanSwitchEvent, RepartitionEvent  # noqa: E402
from ds_recycle.plan import CostModel, PlanCache, make_plan  # noqa: E402
from ds_recycle.plan.partition import balanced_partition, choose_partition  # noqa: E402


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    stages, pipelines = (int(x) for x in args.shape.lower().split("x"))
    slow_workers = [(int(a) % pipelines, int(b) % stages) for a, b in
                    (w.split(":") for w in args.slow_workers.split(","))]
    work = Path(args.workdir).resolve()
    f_ms = f_ms_for(args.f_ms, stages, pipelines)
    model: tuple[str, ...] = ()
    moving = stay = ""
    if args.blocks:
        layers = emulated_layers(stages, args.blocks, f_ms, 3 * 4 * 8.0)
        base = balanced_partition(layers, stages, [pipelines] * stages)
        spec = work / f"layers-{stages}x{pipelines}.json"
        spec.parent.mkdir(parents=True, exist_ok=True)
        spec.write_text(json.dumps({**layers.to_json(), "parts": list(base)}))
        pfile = work / f"costs-{stages}x{pipelines}.json"
        pfile.write_text(json.dumps(layers.stage_costs(base).to_json()))
        model = ("--layer-costs", str(spec))
        moving = json.dumps({"repartition": {"layer_costs_file": str(spec)}})
        stay = json.dumps({"repartition": {"enabled": False}})
    else:
        pfile = write_profile(work / f"profile-{stages}x{pipelines}.json", profile("gpt3-2.7b", stages, pipelines, f_ms))
    costs = CostModel.from_file(pfile)
    lines = [f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores; load at start "
             f"{os.getloadavg()[0]:.1f}",
             f"command: {' '.join(['.venv/bin/python', 'benchmarks/fail_slow.py', *sys.argv[1:]])}",
             f"EMULATED ACCELERATORS, {stages} x {pipelines}, M = {args.microbatches}, slow workers (pipeline, stage) "
             f"{slow_workers} from step {args.from_step}, {args.steps} steps; s/iter = median step time. vanilla: "
             "DeepSpeed 1F1B, slow from that step on. ds_recycle adaptive: 'found' = the steps after the plan switch "
             "that assumes the slow worker(s), 'all' = every slow step (detection included), 'no detect' = "
             "recycle.fail_slow off; S = slow / failure-free of the same system; mitigated = (S0 - S1) / (S0 - 1) "
             "with S1 = found (with --blocks: the steps after the layers moved, 'moved at' iterations after the first "
             "slow step; 'no move' = re-partitioning off); planned = the planner's iteration time with the detected "
             "factors / without (with --blocks: on the partition moved to)",
             f"model: {f'{args.blocks} emulated GPT-3 2.7B blocks a stage' if args.blocks else 'one emulated layer a stage'}"
             f"; the slowest stage's F sleeps {f_ms:g} ms",
             f"{'factor':>6} {'van ff':>7} {'van slow':>8} {'S0':>6} {'rec ff':>7} {'found':>7} {'S1':>6} "
             f"{'S1 all':>6} {'S no det':>8} {'found at':>8} {'moved at':>8} {'no move':>7} {'factors':>16} "
             f"{'planned':>7} {'mitigated':>9}"]
    print("\n".join(lines), flush=True)
    for factor in (float(f) for f in args.factors.split(",")):
        slow = tuple((w, args.from_step, factor) for w in slow_workers)
        cases = {"vanilla ff": Case("vanilla", "vanilla", "1f1b", model_args=model),
                 "vanilla slow": Case("vanilla slow", "vanilla", "1f1b", slow=slow, model_args=model),
                 "recycle ff": Case("recycle", "recycle", model_args=model, recycle_extra=moving),
                 "recycle slow": Case("recycle slow", "recycle", slow=slow, model_args=model, recycle_extra=moving),
                 "recycle no detect": Case("recycle slow, no detection", "recycle", slow=slow, fail_slow=False,
                                           model_args=model, recycle_extra=stay)}
        if args.blocks:
            cases["recycle no move"] = Case("recycle slow, no move", "recycle", slow=slow, model_args=model,
                                            recycle_extra=stay)
        if args.only:
            needed = ("vanilla ff", "vanilla slow", "recycle ff", "recycle slow")
            cases = {k: c for k, c in cases.items() if k in needed or re.search(args.only, k)}
        shares: list[float] = []
        planned_for: dict[tuple[tuple[int, int, float], ...], float] = {}
        for round_ in range(args.rounds):  # cases alternate their order round by round
            res: dict[str, Result] = {}
            order = list(cases.items()) if round_ % 2 == 0 else list(reversed(cases.items()))
            for name, case in order:
                ff = Case(case.name, case.engine, case.schedule, slow=tuple((w, args.from_step, 1.0) for w in slow_workers),
                          model_args=case.model_args, recycle_extra=case.recycle_extra)
                res[name] = run_case(case if case.slow else ff, stages, pipelines, args.microbatches, args.steps, 2, pfile,
                                     pfile, work / (f"x{factor:g}-{name.replace(' ', '-')}"
                                                    + (f"-r{round_}" if args.rounds > 1 else "")))
                if not res[name].ok:
                    raise SystemExit(f"{name} at factor {factor}: {res[name].note}")
            first = args.from_step + 1
            van_ff, van_slow = median_between(res["vanilla ff"], first), median_between(res["vanilla slow"], first)
            rec_ff = median_between(res["recycle ff"], first)
            switched = _switch_step(res["recycle slow"], args.from_step)
            found = median_between(res["recycle slow"], switched + 1) if switched is not None else float("nan")
            moved = _move_step(res["recycle slow"], args.from_step) if args.blocks else None
            if moved is not None:
                found = median_between(res["recycle slow"], moved + 1)
            no_move = float("nan")
            if "recycle no move" in res:
                switched_nm = _switch_step(res["recycle no move"], args.from_step)
                if switched_nm is not None:
                    no_move = median_between(res["recycle no move"], switched_nm + 1) / rec_ff
            every = median_between(res["recycle slow"], first)
            no_detect = (median_between(res["recycle no detect"], first) if "recycle no detect" in res
                         else float("nan"))
            s0, s1 = van_slow / van_ff, found / rec_ff
            mitigated = (s0 - s1) / (s0 - 1) if s0 > 1 else float("nan")
            assumed = [e.slow for e in res["recycle slow"].events if isinstance(e, PlanSwitchEvent) and e.slow]
            factors = ",".join(f"{f:g}" for _, _, f in assumed[0]) if assumed else "-"
            planned = float("nan")
            if assumed and assumed[0] in planned_for:  # rounds that assumed the same factors: planned once
                planned = planned_for[assumed[0]]
            elif assumed:
                found_slow = {(p_, s_): f for p_, s_, f in assumed[0]}
                plans = PlanCache(stages, pipelines, args.microbatches, costs)
                if args.blocks:
                    choice = choose_partition(layers, stages, pipelines, args.microbatches, [], base, slow=found_slow)
                    planned = choice.moved_iteration_s / plans.time_per_iteration([])
                else:
                    planned = (make_plan(stages, pipelines, args.microbatches, costs.with_slow(found_slow)).makespan
                               / plans.time_per_iteration([]))
                planned_for[assumed[0]] = planned
            line = (f"{factor:>6g} {van_ff:>7.3f} {van_slow:>8.3f} {s0:>6.3f} {rec_ff:>7.3f} {found:>7.3f} {s1:>6.3f} "
                    f"{every / rec_ff:>6.3f} {no_detect / rec_ff:>8.3f} "
                    f"{'-' if switched is None else switched - args.from_step:>8} "
                    f"{'-' if moved is None else moved - args.from_step:>8} {no_move:>7.3f} {factors:>16} {planned:>7.3f} "
                    f"{mitigated:>9.3f}")
            print(line, flush=True)
            lines.append(line)
            shares.append(mitigated)
        if args.rounds > 1:
            line = (f"factor {factor:g}: mitigated over {args.rounds} rounds: median {statistics.median(shares):.3f}, "
                    f"min {min(shares):.3f}, max {max(shares):.3f}")
            print(line, flush=True)
            lines.append(line)
    lines.append("found at: iterations from the first slow step to the first step under the plan that assumes it")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
