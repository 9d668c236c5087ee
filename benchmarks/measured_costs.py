"""Plans made from the costs a job measured, against the time per iteration it measured (emulated accelerators).

    .venv/bin/python benchmarks/measured_costs.py [--shape 4x4] [--microbatches 8] [--steps 24] [--out FILE]

EMULATED ACCELERATORS (``benchmarks/emulated/``: F, B, W sleep the GPT-3 2.7B profile's times). ds_recycle runs
failure-free and with one worker absent from the start, each twice: with no costs file (the planner starts from
uniform costs; once per epoch, after 7 iterations, the job builds its costs from its op clocks and switches to the
plan made for them when it is 3% faster under them) and with the profile as ``recycle.costs_file``. At the end each
job times the plan it runs under the costs it measured (``benchmarks/emulated/train.py --print-costs``).
Reported per run: whether and when it switched to measured costs, the measured costs' transfer time, the running
plan's iteration under the measured costs ("planned"), the median step time from the step after the switch (or
after the warm-up) on ("measured"), and measured / planned.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.emulated.profiles import profile, write_profile  # noqa: E402
from benchmarks.emulated_figure import DEFAULT_F_MS, Case, f_ms_for, run_case  # noqa: E402
from benchmarks.fail_slow import median_between  # noqa: E402
from ds_recycle.events import PlanSwitchEvent  # noqa: E402

_COSTS = re.compile(r"measured costs \(ms\) (\{.*\})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="4x4")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--workdir", default=str(REPO / "runs" / "measured-costs"))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    stages, pipelines = (int(x) for x in args.shape.lower().split("x"))
    work = Path(args.workdir).resolve()
    pfile = write_profile(work / f"profile-{stages}x{pipelines}.json",
                          profile("gpt3-2.7b", stages, pipelines, f_ms_for(DEFAULT_F_MS, stages, pipelines)))
    lines = [f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores; load at start "
             f"{os.getloadavg()[0]:.1f}",
             f"command: {' '.join(['.venv/bin/python', 'benchmarks/measured_costs.py', *sys.argv[1:]])}",
             f"EMULATED ACCELERATORS, {stages} x {pipelines}, M = {args.microbatches}, {args.steps} steps, ds_recycle "
             "adaptive; 'switched at': the iteration of the switch to the measured costs' plan ('-': none); planned: "
             "the running plan's iteration under the measured costs; measured: median step time from the step after "
             "the switch (else after the warm-up)",
             f"{'run':<28} {'costs file':>10} {'switched at':>11} {'comm ms':>8} {'planned s':>9} {'measured s':>10} "
             f"{'meas/plan':>9}"]
    print("\n".join(lines), flush=True)
    absent = ((1, 1),)
    for name, lost in (("failure-free", ()), ("worker (1, 1) absent", absent)):
        for with_file in (False, True):
            extra = "" if with_file else json.dumps({"costs_file": None})
            case = Case(name, "recycle", absent=lost, recycle_extra=extra,
                        model_args=("--costs", str(pfile), "--print-costs"))
            tag = f"{'lost' if lost else 'ff'}-{'file' if with_file else 'measured'}"
            res = run_case(case, stages, pipelines, args.microbatches, args.steps, args.warmup, pfile, pfile,
                           work / tag)
            if not res.ok:
                raise SystemExit(f"{tag}: {res.note}")
            found = _COSTS.findall((work / tag / "log.txt").read_text())
            if not found:
                raise SystemExit(f"{tag}: the job printed no measured costs")
            report = json.loads(found[-1])
            switches = [e.iteration for e in res.events if isinstance(e, PlanSwitchEvent) and e.measured]
            first = (switches[0] + 1) if switches else args.warmup + 1
            measured = median_between(res, first)
            planned = report["planned"] / 1e3
            line = (f"{name:<28} {'yes' if with_file else 'no':>10} {switches[0] if switches else '-':>11} "
                    f"{report['comm']:>8.3f} {planned:>9.3f} {measured:>10.3f} {measured / planned:>9.3f}")
            print(line, flush=True)
            lines.append(line)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
