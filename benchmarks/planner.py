"""Planner benchmark: adapted plans against the exact solver on odd shapes, the regular grid, zero-bubble
vs 1F1B, CP-SAT vs HiGHS, planner speed.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/planner.py                      # everything (long)
    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/planner.py --only suite         # heuristic vs exact
    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/planner.py --only exact --only speed
    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/planner.py --only quality --stages 4

suite: odd shapes S in {3, 5, 7} with M not a multiple of S (D in {2, 3, 4}); cost profiles uniform, heavier
first and last stages, W half of B, communication 15% of F, and a GPT-like mix of the three; one to three
failures (first stage, middle, last, spread); a memory limit of S+1 micro-batches per worker with a
first-stage failure (the survivor's load doubles, its memory does not); a synchronous-optimizer case; K=2
iterations (K=1 for the synchronous case). Each case: the adaptive plan (``make_plan``: greedy variants and
the bounded local search), then CP-SAT (``solve_exact``, warm-started from it, --time-limit seconds, 2
workers). "best" is the proven optimum when CP-SAT proves one; otherwise the largest of the proven bounds
(bounds.best_lower_bound, CP-SAT's own bound) and the best failure-free plan of the shape, capped by the
best plan found. Reported: adapted / best (target median <= 1.03, worst <= 1.08), adapted / best found.

quality: the regular grid S in {4, 8, 16}, D in {2, 4, 8}, M in {S, 2S, 4S} (uniform and GPT-like costs;
comm 5% of F; O = 0.5 F), no exact solver, against bounds and the failure-free plan only.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

from ds_recycle.plan import CostModel, PlanCache, lower_bound, make_plan, validate_plan
from ds_recycle.plan.bounds import best_lower_bound, round_trip_bound, routed_lower_bound
from ds_recycle.plan.exact import solve_exact
from ds_recycle.plan.schedules import best_failure_free_time
from ds_recycle.plan.simulator import busy_time

K = 2


def uniform(stages: int) -> CostModel:
    return CostModel.uniform(stages, 1.0, 1.0, 1.0, 0.5, 0.05)


def gpt_like(stages: int) -> CostModel:
    """Transformer blocks: B ~ F, W ~ 0.7 F; stage 0 adds the embedding, the last stage the head and loss."""
    scale = [1.0] * stages
    scale[0] += 0.1
    scale[-1] += 0.3
    return CostModel(tuple(1.0 * x for x in scale), tuple(1.05 * x for x in scale), tuple(0.7 * x for x in scale),
                     (0.5,) * stages, 0.05)


PROFILES = {"uniform": uniform, "gpt-like": gpt_like}


def scenarios(stages: int, pipelines: int) -> dict[str, list[tuple[int, int]]]:
    mid, last = stages // 2, stages - 1
    out = {"none": [], "1 first": [(0, 0)], "1 middle": [(0, mid)], "1 last": [(0, last)]}
    if pipelines >= 3:
        out["2 one stage"] = [(0, mid), (1, mid)]
    out["2 stages"] = [(0, 1), (1, last)]
    out["3 spread"] = [(0, 0), (1, mid), (min(2, pipelines - 1), last)]
    return out


def memory_limit(stages: int, pipelines: int, failed: list[tuple[int, int]]) -> int:
    f_max = max([sum(1 for _, s in failed if s == st) for st in range(stages)] + [0])
    return math.ceil(stages * pipelines / (pipelines - f_max))


def suite_costs(profile: str, stages: int) -> CostModel:
    """The suite's cost profiles (O = 0.5 everywhere)."""
    f, b, w, comm = [1.0] * stages, [1.0] * stages, [1.0] * stages, 0.05
    if profile in ("heavy-ends", "gpt-like"):
        f[0], b[0], f[-1], b[-1] = 1.3, 1.3, 1.5, 1.5
        w[-1] = 1.2
    if profile in ("w-cheap", "gpt-like"):
        w = [0.5 * x for x in b]
    if profile in ("comm15", "gpt-like"):
        comm = 0.15
    return CostModel(tuple(f), tuple(b), tuple(w), (0.5,) * stages, comm)


#: (S, D, M): odd S, M not a multiple of S
SUITE_SHAPES = ((3, 2, 4), (3, 3, 5), (3, 4, 4), (5, 2, 7), (5, 3, 6), (5, 4, 8), (7, 2, 8), (7, 3, 9))


def suite_cases() -> list[dict]:
    cases = []
    for S, D, M in SUITE_SHAPES:
        mid, last = S // 2, S - 1
        base = {"S": S, "D": D, "M": M, "K": K, "limit": None, "optimizer": "staggered"}
        cases.append({**base, "costs": "heavy-ends", "failed": [(0, 0)], "name": "1 first"})
        cases.append({**base, "costs": "w-cheap", "failed": [(0, mid)], "name": "1 middle"})
        cases.append({**base, "costs": "comm15", "failed": [(0, last)], "name": "1 last"})
        cases.append({**base, "costs": "gpt-like", "failed": [(0, 0), (1, last if D > 2 else mid)], "name": "2"})
        if D >= 3:
            cases.append({**base, "costs": "uniform", "failed": [(0, 0), (1, mid), (2, last)], "name": "3 spread"})
        cases.append({**base, "costs": "gpt-like", "failed": [(0, 0)], "name": "1 first", "limit": S + 1})
        cases.append({**base, "costs": "uniform", "failed": [(0, mid)], "name": "1 middle", "K": 1,
                      "optimizer": "synchronous"})
    return cases


def suite(time_limit: float) -> None:
    print(f"\nheuristic vs exact on odd shapes (CP-SAT, {time_limit:g} s limit, 2 workers, warm start from the plan)")
    print(f"{'S':>2} {'D':>2} {'M':>2} {'K':>1} {'costs':>10} {'failed':>9} {'lim':>3} {'opt':>5} | {'plan':>8} "
          f"{'plan s':>6} | {'exact':>8} {'proven':>6} {'bound':>8} {'s':>5} | {'best':>8} {'/best':>6} {'/found':>6}")
    ratios, found, proven = [], [], 0
    for case in suite_cases():
        S, D, M, k = case["S"], case["D"], case["M"], case["K"]
        costs = suite_costs(case["costs"], S)
        kw = {"iterations": k, "optimizer": case["optimizer"], "memory_limit": case["limit"]}
        began = time.process_time()
        plan = make_plan(S, D, M, costs, case["failed"], **kw)
        plan_s = time.process_time() - began
        validate_plan(plan)
        exact = solve_exact(S, D, M, costs, case["failed"], time_limit=time_limit, greedy=plan, **kw)
        validate_plan(exact.plan)
        bounds = max(best_lower_bound(S, D, M, costs, case["failed"], k, optimizer=case["optimizer"],
                                      memory_limit=case["limit"]),
                     best_failure_free_time(S, D, M, costs, **kw), exact.dual_bound)
        best = exact.plan.makespan if exact.optimal else min(exact.plan.makespan, bounds)
        proven += exact.optimal
        ratios.append(plan.makespan / best)
        found.append(plan.makespan / exact.plan.makespan)
        print(f"{S:>2} {D:>2} {M:>2} {k:>1} {case['costs']:>10} {case['name']:>9} {str(case['limit']):>3} "
              f"{case['optimizer'][:5]:>5} | {plan.makespan:>8.2f} {plan_s:>6.2f} | {exact.plan.makespan:>8.2f} "
              f"{str(exact.optimal):>6} {exact.dual_bound:>8.2f} {exact.seconds:>5.1f} | {best:>8.2f} "
              f"{ratios[-1]:>6.3f} {found[-1]:>6.3f}", flush=True)
    print(f"  {len(ratios)} cases, {proven} proven optimal by CP-SAT")
    print(f"  adapted / best possible: median {statistics.median(ratios):.4f}, worst {max(ratios):.4f} "
          f"(target: median <= 1.03, worst <= 1.08)")
    print(f"  adapted / best plan found (CP-SAT's): median {statistics.median(found):.4f}, worst {max(found):.4f}")


def quality_rows(stage_list: list[int]) -> list[dict]:
    rows = []
    for S in stage_list:
        for D in (2, 4, 8):
            for M in (S, 2 * S, 4 * S):
                for profile, make_costs in PROFILES.items():
                    costs = make_costs(S)
                    for name, failed in scenarios(S, D).items():
                        rows.append(_row(S, D, M, profile, costs, name, failed))
                        print(_format(rows[-1]), flush=True)
    return rows


def _row(S: int, D: int, M: int, profile: str, costs: CostModel, name: str, failed: list) -> dict:
    bound = lower_bound(S, D, M, costs, failed, K)
    routed = routed_lower_bound(S, D, M, costs, failed, K)
    tight = max(routed, round_trip_bound(S, D, M, costs, failed, K))
    out = {"S": S, "D": D, "M": M, "costs": profile, "failed": name, "bound": bound / K}
    for tag, limit in (("inf", None), ("lim", memory_limit(S, D, failed))):
        plan = make_plan(S, D, M, costs, failed, iterations=K, memory_limit=limit)
        free = best_failure_free_time(S, D, M, costs, iterations=K, memory_limit=limit)
        best = max(bound, free)
        out[f"{tag}_time"] = plan.time_per_iteration
        out[f"{tag}_best"] = plan.makespan / best
        out[f"{tag}_lb"] = plan.makespan / bound
        out[f"{tag}_routed"] = plan.makespan / max(routed, free)
        out[f"{tag}_tight"] = plan.makespan / max(tight, free)
        out[f"{tag}_kept"] = free / plan.makespan
        out[f"{tag}_best_kept"] = free / best
        out["limit"] = limit
    return out


HEADER = (f"{'S':>3} {'D':>2} {'M':>3} {'costs':>8} {'failed':>12} {'bound/it':>9} | {'no limit: t/it':>14} "
          f"{'/best':>6} {'/LB':>6} {'/rbest':>6} {'kept':>6} {'best kept':>9} | {'lim':>3} {'t/it':>9} {'/best':>6} "
          f"{'/LB':>6} {'/rbest':>6} {'kept':>6}")


def _format(r: dict) -> str:
    return (f"{r['S']:>3} {r['D']:>2} {r['M']:>3} {r['costs']:>8} {r['failed']:>12} {r['bound']:>9.2f} | "
            f"{r['inf_time']:>14.2f} {r['inf_best']:>6.3f} {r['inf_lb']:>6.3f} {r['inf_routed']:>6.3f} "
            f"{r['inf_kept']:>6.3f} {r['inf_best_kept']:>9.3f} | {r['limit']:>3} {r['lim_time']:>9.2f} "
            f"{r['lim_best']:>6.3f} {r['lim_lb']:>6.3f} {r['lim_routed']:>6.3f} {r['lim_kept']:>6.3f}")


def summarize(rows: list[dict]) -> None:
    print("\nsummary over adapted plans with at least one failure (target: median <= 1.03, worst <= 1.08 vs best)")
    failed = [r for r in rows if r["failed"] != "none"]
    for tag, label in (("inf", "no memory limit"), ("lim", "memory limit ceil(S*D/(D-f_max))")):
        for key, what in (("best", "adapted / best possible"), ("lb", "adapted / lower bound"),
                          ("routed", "adapted / routed best"), ("tight", "adapted / tight best")):
            values = [r[f"{tag}_{key}"] for r in failed]
            worst = max(failed, key=lambda r: r[f"{tag}_{key}"])
            print(f"  {label:34} {what:26} median {statistics.median(values):.4f}  worst {max(values):.4f} "
                  f"(S={worst['S']} D={worst['D']} M={worst['M']} {worst['costs']} {worst['failed']})")
        kept = [r[f"{tag}_kept"] / r[f"{tag}_best_kept"] for r in failed]
        print(f"  {label:34} {'throughput kept / best':26} median {statistics.median(kept):.4f}  worst {min(kept):.4f}")


def bubbles(stage_list: list[int]) -> None:
    print("\nfailure-free bubble, K=1, synchronous optimizer (1F1B as DeepSpeed runs it: fused B+W) "
          "vs ZB-H1 (memory S); target zb/1f1b <= 0.4")
    print("bubble = idle worker-time (workers x makespan - busy); also shown as a fraction of workers x makespan")
    print(f"{'S':>3} {'M':>3} {'costs':>8} {'1f1b idle':>9} {'zb idle':>8} {'ratio':>6} | {'1f1b frac':>9} "
          f"{'zb frac':>8} {'ratio':>6}")
    ratios, frac_ratios = [], []
    for S in stage_list:
        for M in (S, 2 * S, 4 * S):
            for profile, make_costs in PROFILES.items():
                costs = make_costs(S)
                idle, frac = {}, {}
                for schedule in ("1f1b", "zb-h1"):
                    plan = make_plan(S, 1, M, costs, schedule=schedule, optimizer="synchronous")
                    total = len(plan.workers) * plan.makespan
                    idle[schedule] = total - busy_time(plan.workers)
                    frac[schedule] = idle[schedule] / total
                ratios.append(idle["zb-h1"] / idle["1f1b"])
                frac_ratios.append(frac["zb-h1"] / frac["1f1b"])
                print(f"{S:>3} {M:>3} {profile:>8} {idle['1f1b']:>9.2f} {idle['zb-h1']:>8.2f} {ratios[-1]:>6.3f} | "
                      f"{frac['1f1b']:>9.4f} {frac['zb-h1']:>8.4f} {frac_ratios[-1]:>6.3f}")
    for label, values in (("idle time", ratios), ("bubble fraction", frac_ratios)):
        uni = [v for v, i in zip(values, range(len(values))) if i % 2 == 0]
        print(f"  zb-h1 / 1f1b {label}: median {statistics.median(values):.3f}, worst {max(values):.3f}; "
              f"uniform costs only: median {statistics.median(uni):.3f}, worst {max(uni):.3f}")


def exact_gap(time_limit: float) -> None:
    print(f"\nexact solvers on the same instances, {time_limit:g} s limit each: OR-Tools CP-SAT (2 workers) vs HiGHS "
          "(scipy.optimize.milp); both warm-started from / bounded by the greedy plan (search off), K=1")
    print(f"{'S':>2} {'D':>2} {'M':>2} {'failed':>16} {'limit':>5} {'greedy':>8} | {'CP-SAT':>8} {'proven':>6} "
          f"{'bound':>8} {'s':>5} | {'HiGHS':>8} {'proven':>6} {'bound':>8} {'s':>5}")
    tally = {"cp-sat": [0, 0.0], "highs": [0, 0.0]}
    for S, D, M, failed, limit in ((2, 1, 4, [], 2), (2, 2, 2, [(0, 1)], None), (2, 2, 3, [(1, 0)], 2),
                                   (3, 1, 3, [], 2), (3, 2, 2, [(1, 1)], 2), (3, 2, 3, [(0, 2)], 3),
                                   (3, 2, 4, [(1, 1)], 3), (3, 3, 4, [(0, 0)], None), (3, 3, 5, [(0, 0), (1, 2)], None),
                                   (4, 2, 5, [(1, 0)], None)):
        costs = CostModel((1.0,) * S, (1.5,) * S, (0.5,) * S, (0.2,) * S, 0.1)
        greedy = make_plan(S, D, M, costs, failed, memory_limit=limit, search=0)
        cells = []
        for solver in ("cp-sat", "highs"):
            r = solve_exact(S, D, M, costs, failed, memory_limit=limit, time_limit=time_limit, solver=solver,
                            greedy=greedy)
            validate_plan(r.plan)
            tally[solver][0] += r.optimal
            tally[solver][1] += r.seconds
            cells.append(f"{r.plan.makespan:>8.3f} {str(r.optimal):>6} {r.dual_bound:>8.3f} {r.seconds:>5.1f}")
        print(f"{S:>2} {D:>2} {M:>2} {str(failed):>16} {str(limit):>5} {greedy.makespan:>8.3f} | {cells[0]} | {cells[1]}",
              flush=True)
    for solver, (count, secs) in tally.items():
        print(f"  {solver}: {count} of 10 proven optimal, {secs:.1f} s in all")


BIG = ["--stages", "16", "--pipelines", "8", "--microbatches", "64", "--iterations", "2", "--costs", "1,1,1,0.3,0.05",
       "--fail", "0:3", "--fail", "5:3", "--fail", "2:11", "--json"]


def speed() -> None:
    print("\nplanner speed (CPU seconds are what the planner costs; wall seconds also count the other jobs sharing "
          "the machine)")
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        began = time.perf_counter()
        subprocess.run([sys.executable, "-m", "ds_recycle.cli", "plan", *BIG, "/tmp/ds-recycle-bench-plan.json"],
                       check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - began
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        print(f"  ds-recycle plan {' '.join(BIG)} FILE (end to end, a new process): {wall:.2f} s wall, {cpu:.2f} s "
              f"CPU (target < 1 s; load average {os.getloadavg()[0]:.1f})")
    costs = uniform(16)
    failed = [(0, 0), (1, 8), (2, 15)]
    for label, variants, limit in (("default (one greedy variant at this size)", None, None),
                                   ("memory limit 19, default (two variants)", None, 19),
                                   ("all six greedy variants", 6, None)):
        began, cpu = time.perf_counter(), time.process_time()
        make_plan(16, 8, 64, costs, failed, iterations=K, variants=variants, memory_limit=limit)
        print(f"  make_plan S=16 D=8 M=64 K=2, three failures, {label}: {time.perf_counter() - began:.2f} s wall, "
              f"{time.process_time() - cpu:.2f} s CPU")
    cache = PlanCache(8, 8, 32, uniform(8), iterations=K)
    began, cpu = time.perf_counter(), time.process_time()
    count = cache.precompute(2)
    print(f"  precompute every single and double failure, S=8 D=8 M=32 K=2: {count} plans, "
          f"{time.perf_counter() - began:.1f} s wall, {time.process_time() - cpu:.1f} s CPU, one process "
          f"(target < 60 s on 2 cores; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    began = time.perf_counter()
    for _ in range(1000):
        cache.time_per_iteration([(5, 3), (2, 6)])
    print(f"    time_per_iteration lookup (normalize + dict): {(time.perf_counter() - began) * 1000:.1f} us each")
    began = time.perf_counter()
    cache.get([(5, 3), (2, 6)])
    print(f"    first get of a renamed plan (relabels {sum(len(o) for o in cache.get([(5, 3), (2, 6)]).workers.values())} "
          f"ops): {(time.perf_counter() - began) * 1000:.1f} ms; later gets are a dict lookup")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, action="append", help="quality grid: only these S (repeatable)")
    parser.add_argument("--only", action="append", choices=SECTIONS, help="run only these sections (repeatable)")
    parser.add_argument("--time-limit", type=float, default=10.0, help="seconds per exact solve (default 10)")
    args = parser.parse_args()
    stage_list = args.stages or [4, 8, 16]
    sections = args.only or list(SECTIONS)
    print(f"# ds_recycle planner benchmark, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"# {platform.node()} {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}, OR-Tools {_ortools_version()}, load average {os.getloadavg()[0]:.1f}")
    print(f"# command: PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/planner.py {' '.join(sys.argv[1:])}")
    if "suite" in sections:
        suite(args.time_limit)
    if "quality" in sections:
        print(HEADER)
        summarize(quality_rows(stage_list))
    if "bubbles" in sections:
        bubbles(stage_list)
    if "exact" in sections:
        exact_gap(args.time_limit)
    if "speed" in sections:
        speed()


SECTIONS = ("suite", "quality", "bubbles", "exact", "speed")


def _ortools_version() -> str:
    from importlib.metadata import version
    return version("ortools")


if __name__ == "__main__":
    main()
