"""Planner benchmark: quality of adapted plans, zero-bubble vs 1F1B, greedy vs exact, planner speed.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/planner.py              # the whole table (minutes)
    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/planner.py --stages 4   # one S only

Grid: S in {4, 8, 16}, D in {2, 4, 8}, M in {S, 2S, 4S}; failures: none, one in the first, a middle and the
last stage, two in one stage, two in different stages, three spread; K=2 iterations, staggered optimizer;
comm = 5% of F; O = 0.5 F. Two cost profiles: uniform (F=B=W=1) and GPT-like (W cheaper than B, first and
last stage heavier for the embedding and the LM head/loss; see GPT_LIKE).

"best possible" = max(plan-format lower bound, best failure-free plan of the same shape, costs and memory
setting). "/rbest" uses the routed bound instead (bounds.routed_lower_bound: a micro-batch keeps its worker
in every iteration, as the engine's contract requires, so the busiest peer carries ceil(D*M/(D-f)) each
iteration rather than ceil(K*D*M/(D-f)) over K iterations). The summary also reports "tight best": the
larger of that, the failure-free plan and bounds.round_trip_bound (stage 0 waits for a full round trip of
its first micro-batch in every iteration, which the plan format's formula leaves out). Two memory settings: unlimited,
and a limit of ceil(S * D / (D - f_max)) micro-batches per
worker (f_max: most failures in one stage), i.e. 1F1B's first-stage memory scaled by the re-routed load.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
import time

from ds_recycle.plan import CostModel, PlanCache, lower_bound, make_plan
from ds_recycle.plan.bounds import round_trip_bound, routed_lower_bound
from ds_recycle.plan.exact import solve_exact
from ds_recycle.plan.schedules import best_failure_free
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
        free = best_failure_free(S, D, M, costs, iterations=K, memory_limit=limit).makespan
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


def exact_gap() -> None:
    print("\ngreedy vs exact MILP (scipy.optimize.milp / HiGHS, 20 s limit each), uniform costs with O, comm, K=1")
    print(f"{'S':>2} {'D':>2} {'M':>2} {'failed':>10} {'limit':>5} {'greedy':>8} {'exact':>8} {'proven':>6} "
          f"{'dual bd':>8} {'gap':>6} {'secs':>5}")
    gaps = []
    for S, D, M, failed, limit in ((2, 1, 4, [], 2), (2, 2, 2, [(0, 1)], None), (2, 2, 3, [(1, 0)], 2),
                                   (3, 1, 3, [], 2), (3, 2, 2, [(1, 1)], 2), (3, 2, 3, [(0, 2)], 3),
                                   (3, 2, 4, [(1, 1)], 3), (3, 2, 4, [], 3)):
        costs = CostModel((1.0,) * S, (1.5,) * S, (0.5,) * S, (0.2,) * S, 0.1)
        began = time.perf_counter()
        r = solve_exact(S, D, M, costs, failed, memory_limit=limit, time_limit=20)
        gaps.append(r.gap)
        print(f"{S:>2} {D:>2} {M:>2} {str(failed):>10} {str(limit):>5} {r.heuristic_makespan:>8.3f} "
              f"{r.plan.makespan:>8.3f} {str(r.optimal):>6} {r.dual_bound:>8.3f} {r.gap:>6.3%} "
              f"{time.perf_counter() - began:>5.1f}")
    print(f"  greedy / exact - 1: mean {statistics.mean(gaps):.3%}, worst {max(gaps):.3%}")


def speed() -> None:
    print("\nplanner speed")
    costs = uniform(16)
    failed = [(0, 0), (1, 8), (2, 15)]
    for label, variants, limit in (("default (one greedy variant at this size)", None, None),
                                   ("memory limit 19, default (two variants)", None, 19),
                                   ("all six greedy variants", 6, None)):
        began, cpu = time.perf_counter(), time.process_time()
        make_plan(16, 8, 64, costs, failed, iterations=K, variants=variants, memory_limit=limit)
        print(f"  S=16 D=8 M=64 K=2, three failures, {label}: {time.perf_counter() - began:.2f} s wall, "
              f"{time.process_time() - cpu:.2f} s CPU (target < 1 s)")
    cache = PlanCache(8, 8, 32, uniform(8), iterations=K)
    began, cpu = time.perf_counter(), time.process_time()
    count = cache.precompute(2)
    print(f"  precompute every single and double failure, S=8 D=8 M=32 K=2: {count} plans, "
          f"{time.perf_counter() - began:.1f} s wall, {time.process_time() - cpu:.1f} s CPU, one process "
          f"(target < 60 s on 2 cores)")
    print(f"  (load average while measuring: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
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
    parser.add_argument("--stages", type=int, action="append", help="only these S (repeatable)")
    parser.add_argument("--skip", action="append", default=[], choices=["quality", "bubbles", "exact", "speed"])
    args = parser.parse_args()
    stage_list = args.stages or [4, 8, 16]
    print(f"# ds_recycle planner benchmark, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"# {platform.node()} {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}")
    print(f"# command: PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/planner.py {' '.join(sys.argv[1:])}")
    if "quality" not in args.skip:
        print(HEADER)
        summarize(quality_rows(stage_list))
    if "bubbles" not in args.skip:
        bubbles(stage_list)
    if "exact" not in args.skip:
        exact_gap()
    if "speed" not in args.skip:
        speed()


if __name__ == "__main__":
    main()
