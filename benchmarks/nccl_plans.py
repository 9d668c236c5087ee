"""Which plans the engine would run can go over NCCL point-to-point (engine/nccl_check.py).

    .venv/bin/python benchmarks/nccl_plans.py [--out FILE]

The sweep of ``benchmarks/plan_w_order.py`` (the plan cache the failure handler uses; shapes 2x2..4x4, M = S and
2S, the three schedules, uniform and random costs, no, one and some pairs of failed workers): for each plan, whether
every pair's messages are received in the order they are sent (FIFO matching without tags) and whether NCCL's wait
model (a group of transfers completes once all of them are matched; compute between transfers splits groups) lets
every worker finish, with the transfers in batches as the lowering places them (receives before their compute,
sends after) and as the engine issues them: the batches its ``PostTransfers`` post, in the job's match order
(:func:`ds_recycle.engine.issue.issued_schedule`). Static: no process, no GPU.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.plan_sweep import sweep  # noqa: E402
from ds_recycle.engine.issue import issued_program  # noqa: E402
from ds_recycle.engine.nccl_check import (  # noqa: E402
    NcclPlanError,
    batches_as_lowered,
    check_order,
    check_waits,
    timeline,
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    count: Counter[tuple[str, str, str]] = Counter()
    first: dict[tuple[str, str], str] = {}
    began = time.perf_counter()
    for swept in sweep(("1f1b", "zb-h1", "adaptive")):
        items_of = timeline(swept.plan)
        program = {rank: batches_as_lowered(items) for rank, items in items_of.items()}
        ordered = issued_program(swept.plan)
        case = "failure-free" if not swept.failed else "with failures"
        for name, check, prog in (("order", check_order, program), ("waits", check_waits, program),
                                  ("ordered order", check_order, ordered), ("ordered waits", check_waits, ordered)):
            try:
                check(prog)
                count[(swept.schedule, case, name + " ok")] += 1
            except NcclPlanError as e:
                count[(swept.schedule, case, name + " bad")] += 1
                first.setdefault((swept.schedule, name), f"  {swept.describe()}: {str(e)[:300]}")
    lines = [f"machine: 2-core CPU VM; static, no training; {time.perf_counter() - began:.0f} s; command: "
             ".venv/bin/python benchmarks/nccl_plans.py",
             f"{'schedule':<9} {'plans':<14} {'checked':>7} {'order ok':>8} {'no wait cycle':>13} "
             f"{'as the engine issues: order ok':>30} {'no wait cycle':>13}"]
    for schedule in ("1f1b", "zb-h1", "adaptive"):
        for case in ("failure-free", "with failures"):
            ok_o, bad_o = count[(schedule, case, "order ok")], count[(schedule, case, "order bad")]
            ok_w = count[(schedule, case, "waits ok")]
            ok_mo, ok_mw = count[(schedule, case, "ordered order ok")], count[(schedule, case, "ordered waits ok")]
            lines.append(f"{schedule:<9} {case:<14} {ok_o + bad_o:>7} {ok_o:>8} {ok_w:>13} {ok_mo:>30} {ok_mw:>13}")
    lines.append("first violation of each kind:")
    lines += [first[k] for k in sorted(first)] or ["  none"]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
