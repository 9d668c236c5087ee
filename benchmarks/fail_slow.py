"""Fail-slow on emulated accelerators: one worker runs slower from an iteration on; each system against its own
failure-free run.

    .venv/bin/python benchmarks/fail_slow.py [--shape 4x4] [--microbatches 8] [--factors 2] [--from-step 4] \
        [--steps 12] [--out FILE]

EMULATED ACCELERATORS (``benchmarks/emulated/``: F, B, W sleep the GPT-3 2.7B profile's time; a slow worker's
sleeps are ``factor`` times longer from ``--from-step`` on, :func:`benchmarks.emulated.layers.set_slowdown`). Cases
per factor, run one after the other: vanilla DeepSpeed (1F1B) failure-free and with the slow worker (pipeline 1,
stage 1), ds_recycle (adaptive, under ``ds-recycle launch``) failure-free and with it. Reported: the median time
per iteration from the first slow step on, the slowdowns S0 (vanilla) and S1 (ds_recycle) against their own
failure-free runs, and the share of the slowdown mitigated, (S0 - S1) / (S0 - 1).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.emulated.profiles import profile, write_profile  # noqa: E402
from benchmarks.emulated_figure import DEFAULT_F_MS, Case, f_ms_for, run_case  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="4x4")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--factors", default="2", help="comma-separated slowdown factors")
    p.add_argument("--from-step", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--workdir", default=str(REPO / "runs" / "fail-slow"))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    stages, pipelines = (int(x) for x in args.shape.lower().split("x"))
    work = Path(args.workdir)
    pfile = write_profile(work / f"profile-{stages}x{pipelines}.json",
                          profile("gpt3-2.7b", stages, pipelines, f_ms_for(DEFAULT_F_MS, stages, pipelines)))
    slow_worker = (1 % pipelines, 1 % stages)
    lines = [f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores; load at start "
             f"{os.getloadavg()[0]:.1f}",
             f"command: {' '.join(['.venv/bin/python', 'benchmarks/fail_slow.py', *sys.argv[1:]])}",
             f"EMULATED ACCELERATORS, {stages} x {pipelines}, M = {args.microbatches}, slow worker (pipeline, stage) "
             f"{slow_worker} from step {args.from_step}; s/iter = median from that step on",
             f"{'factor':>6} {'vanilla ff':>10} {'vanilla slow':>12} {'S0':>6} {'recycle ff':>10} "
             f"{'recycle slow':>12} {'S1':>6} {'mitigated':>9}"]
    print("\n".join(lines), flush=True)
    for factor in (float(f) for f in args.factors.split(",")):
        slow = ((slow_worker, args.from_step, factor),)
        cases = {"vanilla ff": Case("vanilla", "vanilla", "1f1b"),
                 "vanilla slow": Case("vanilla slow", "vanilla", "1f1b", slow=slow),
                 "recycle ff": Case("recycle", "recycle"),
                 "recycle slow": Case("recycle slow", "recycle", slow=slow)}
        timed: dict[str, float] = {}
        for name, case in cases.items():
            ff = Case(case.name, case.engine, case.schedule, slow=((slow_worker, args.from_step, 1.0),))
            res = run_case(case if case.slow else ff, stages, pipelines, args.microbatches, args.steps, 2, pfile,
                           pfile, work / f"x{factor:g}-{name.replace(' ', '-')}")
            if not res.ok:
                raise SystemExit(f"{name} at factor {factor}: {res.note}")
            timed[name] = res.per_iteration
        s0 = timed["vanilla slow"] / timed["vanilla ff"]
        s1 = timed["recycle slow"] / timed["recycle ff"]
        mitigated = (s0 - s1) / (s0 - 1) if s0 > 1 else float("nan")
        line = (f"{factor:>6g} {timed['vanilla ff']:>10.3f} {timed['vanilla slow']:>12.3f} {s0:>6.3f} "
                f"{timed['recycle ff']:>10.3f} {timed['recycle slow']:>12.3f} {s1:>6.3f} {mitigated:>9.3f}")
        print(line, flush=True)
        lines.append(line)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
