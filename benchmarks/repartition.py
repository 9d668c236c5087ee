"""Lasting failures on emulated accelerators: re-routing alone against re-routing with re-partitioned layers.

    .venv/bin/python benchmarks/repartition.py --shapes 4x4 --microbatches 8 \
        --out benchmarks/results/repartition-$(date +%F).txt
    .venv/bin/python benchmarks/repartition.py --shapes 8x4 --microbatches 8,16 --out ...

Every job is the user-style script ``benchmarks/emulated/train.py`` under ``ds-recycle launch``, on the emulated
GPT built from per-layer costs (``--layer-costs``): ``--blocks`` transformer blocks a stage (GPT-3 2.7B's per-layer
F, B, W ratios, arXiv 2104.04473 section 5.1 split as in arXiv 2401.10241; scaled so that a stage of blocks has
an F of ``--f-ms``), the head's compute as one more block, the real embedding and head. The job's own partition
is the balanced one (:func:`ds_recycle.plan.partition.balanced_partition` with every replica live).

Cases, per shape and M, alternated round after round:

- ``failure-free``: every worker, the job's own partition;
- ``1 lost, re-routed`` / ``re-partitioned``: worker ``(0, 1)`` absent from the start (``recycle.assume_failed``),
  on the job's own partition (re-routing alone) or on the one the planner chooses for that failure
  (:func:`ds_recycle.plan.partition.choose_partition`): the two steady states (``recycle.repartition.enabled``
  false in both, so nothing moves); the same for two workers lost in one stage;
- ``1 killed, re-routing only``: worker ``(0, 1)`` SIGKILLed from outside once step ``--kill-after`` is printed,
  never restarted, ``recycle.repartition.enabled`` false;
- ``1 killed, layers move``: the same kill with re-partitioning on (the default; ``layer_costs_file`` the emulated
  model's per-layer costs): the layers move a few iterations later, from live holders;
- ``1 killed, back at rejoin``: the same, the killed worker started again ``--restart-s`` later: the layers move
  there, then back before it joins.

The report gives, per case, the measured time per iteration (for the kills: after the last move or rejoin), the
planner's time for the same plan, the throughput kept against failure-free (measured and planned), the bound
``(S D - f) / (S D)``, the whole-layer balance bound (:func:`ds_recycle.plan.partition.granularity_bound`), the
moving step's pause and the transfer's time, and the job's memory.
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
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.emulated_figure import Case, Result, run_case  # noqa: E402
from ds_recycle.cluster.models import A100_NODE, get_model, layer_costs  # noqa: E402
from ds_recycle.events import RejoinEvent, RepartitionEvent  # noqa: E402
from ds_recycle.plan import make_plan  # noqa: E402
from ds_recycle.plan.partition import LayerCosts, Partition, balanced_partition, choose_partition, granularity_bound  # noqa: E402

Worker = tuple[int, int]

BLOCK_STATE_GB = 16 * 12 * get_model("gpt3-2.7b").hidden ** 2 / 1e9
"""Mixed-precision Adam state of one GPT-3 2.7B layer (ZeRO, arXiv 1910.02054, section 3.1)."""


def emulated_layers(stages: int, blocks: int, f_ms: float, width_bytes: float) -> LayerCosts:
    """Per-layer costs in ms: embedding (free), ``blocks x stages`` blocks, the head's compute, the real head."""
    real = layer_costs(get_model("gpt3-2.7b"), A100_NODE, 1, 1)
    block_f = f_ms / blocks
    scale = block_f / real.F[1]
    f, b, w = real.F[1] * scale, real.B[1] * scale, real.W[1] * scale
    head = real.F[-1] * scale
    n = blocks * stages
    return LayerCosts(F=(0.0, *[f] * n, head, 0.0), B=(0.0, *[b] * n, head, 0.0), W=(0.0, *[w] * n, head, 0.0),
                      O=(0.0,) * (n + 3), state_bytes=(width_bytes,) * (n + 3))


def _write(path: Path, obj: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1) + "\n")
    return path


def cases(stages: int, pipelines: int, microbatches: int, layers: LayerCosts, base: Partition, work: Path,
          kill_after: int, restart_s: float) -> list[tuple[Case, Path, Partition, tuple[Worker, ...]]]:
    """(case, planner costs file, partition it ends on, failed) for one shape and M."""
    s1 = 1 % stages
    lost = (0, s1)
    sets: list[tuple[str, tuple[Worker, ...]]] = [("1 lost", (lost,))]
    if pipelines > 2:
        sets.append(("2 lost, one stage", (lost, (1, s1))))
    out = []
    base_spec = _write(work / f"layers-{stages}x{pipelines}.json", {**layers.to_json(), "parts": list(base)})
    moving = json.dumps({"repartition": {"layer_costs_file": str(base_spec)}})

    def case(name: str, parts: Partition, failed: tuple[Worker, ...], ends: Partition | None = None,
             **how: Any) -> None:
        """A job built on ``parts`` (its planner costs those of ``parts``) that ends on ``ends`` (default: ``parts``)."""
        tag = "-".join(map(str, parts))
        spec = _write(work / f"layers-{stages}x{pipelines}-{tag}.json", {**layers.to_json(), "parts": list(parts)})
        costs = _write(work / f"costs-{stages}x{pipelines}-{tag}.json", layers.stage_costs(parts).to_json())
        out.append((Case(name, "recycle", model_args=("--layer-costs", str(spec), "--print-costs"), **how), costs,
                    ends or parts, failed))

    steady = json.dumps({"repartition": {"enabled": False}})
    case("failure-free", base, (), recycle_extra=steady)
    for name, failed in sets:
        choice = choose_partition(layers, stages, pipelines, microbatches, failed, base)
        case(f"{name}, re-routed", base, failed, absent=failed, recycle_extra=steady)
        case(f"{name}, re-partitioned", choice.partition, failed, absent=failed, recycle_extra=steady)
    choice = choose_partition(layers, stages, pipelines, microbatches, (lost,), base)
    kill = ((lost, kill_after),)
    case("1 killed, re-routing only", base, (lost,), sigkill=kill, recycle_extra=steady)
    case("1 killed, layers move", base, (lost,), ends=choice.partition, sigkill=kill, recycle_extra=moving)
    case("1 killed, back at rejoin", base, (), sigkill=kill, recycle_extra=moving,
         launcher_args=("--restart_failed_after", str(restart_s)))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="4x4", help="comma-separated SxD")
    p.add_argument("--microbatches", default="8", help="comma-separated M")
    p.add_argument("--blocks", type=int, default=16, help="emulated transformer blocks a stage")
    p.add_argument("--f-ms", default="4x4=100,8x4=200", help="F of a stage of blocks, ms: a number or SxD=ms pairs")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--kill-after", type=int, default=2, help="kill once the reporter printed this step")
    p.add_argument("--restart-s", type=float, default=20.0, help="the rejoin case restarts the killed worker after this")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--only", default=None, help="regex: run only the cases whose name matches")
    p.add_argument("--workdir", default=str(REPO / "runs" / "repartition"))
    p.add_argument("--out", default=None, help="report file (.txt; the raw results go to .jsonl next to it)")
    args = p.parse_args()
    if args.blocks < 16:
        p.error(f"--blocks {args.blocks}: re-partitioning is measured with at least 16 blocks a stage")
    work = Path(args.workdir)
    f_ms: dict[str, float] = {}
    for item in args.f_ms.split(","):
        shape, _, ms = item.rpartition("=")
        f_ms[shape.strip().lower()] = float(ms)
    runs: list[tuple[int, int, int, Case, Path, Partition, tuple[Worker, ...], LayerCosts]] = []
    for shape in args.shapes.split(","):
        s, d = (int(x) for x in shape.lower().split("x"))
        layers = emulated_layers(s, args.blocks, f_ms.get(f"{s}x{d}", f_ms.get("", 100.0)), 3 * 4 * 8.0)
        base = balanced_partition(layers, s, [d] * s)
        for mtext in args.microbatches.split(","):
            m = int(mtext)
            for case, costs, parts, failed in cases(s, d, m, layers, base, work / f"{s}x{d}-m{m}", args.kill_after,
                                                    args.restart_s):
                if args.only is None or re.search(args.only, case.name):
                    runs.append((s, d, m, case, costs, parts, failed, layers))
    head = [f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores; load average at start "
            f"{os.getloadavg()[0]:.1f}",
            f"command: .venv/bin/python benchmarks/repartition.py {' '.join(sys.argv[1:])}",
            "EMULATED ACCELERATORS: F, B, W sleep the costs (benchmarks/emulated/); runtime, transport, optimizer and "
            "all-reduce run for real",
            f"{args.blocks} blocks a stage (GPT-3 2.7B per-layer ratios), {args.steps} steps, {args.warmup} warm-up, "
            f"{args.rounds} round(s), cases alternated; 'lost' cases start without the worker (steady states), "
            f"'killed' ones SIGKILL it once step {args.kill_after} is printed, never restarted except in the rejoin "
            f"case ({args.restart_s:g} s later)"]
    for line in head:
        print(line, flush=True)
    partial = Path(args.out).with_suffix(".jsonl") if args.out else work / "results.jsonl"
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_text("")
    results: dict[tuple[int, int, int, str], list[Result]] = {}
    for r in range(args.rounds):
        for i, (s, d, m, case, costs, _parts, _failed, _layers) in enumerate(runs):
            tag = re.sub(r"[^a-z0-9]+", "-", case.name.lower()).strip("-")
            res = run_case(case, s, d, m, args.steps, args.warmup, Path("unused"), costs,
                           work / f"{s}x{d}-m{m}" / f"{tag}-r{r}")
            results.setdefault((s, d, m, case.name), []).append(res)
            with partial.open("a") as f:
                f.write(json.dumps({"stages": s, "pipelines": d, "microbatches": m, "case": case.name,
                                    "ok": res.ok, "note": res.note, "times": res.times, "stamps": res.stamps,
                                    "events": [e.to_dict() for e in res.events],
                                    "peak_rss_gb": res.peak_rss_gb}) + "\n")
            print(f"  [{i + 1}/{len(runs)} round {r + 1}] {s}x{d} M={m} {case.name}: {res.per_iteration:.3f} s/iter"
                  + ("" if res.ok else f"  FAILED: {res.note}"), flush=True)
    lines = head + report(runs, results)
    print("\n".join(lines[len(head):]))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0 if all(x.ok for rs in results.values() for x in rs) else 1


def _window(res: Result) -> tuple[list[float], float, float]:
    """Step times after the last event that changes the job (a move, a rejoin), the moving step's extra time over
    their median, and the longest move on any worker (s); steady cases: every timed step."""
    moves = [e for e in res.events if isinstance(e, RepartitionEvent)]
    joins = [e for e in res.events if isinstance(e, RejoinEvent)]
    marks = [e.iteration for e in moves] + [e.iteration for e in joins]
    if not marks:
        return res.times, float("nan"), float("nan")
    last = max(marks)
    stamps = res.stamps
    after = [stamps[k] - stamps[k - 1] for k in sorted(stamps) if k > last + 1 and k - 1 in stamps]
    pause = float("nan")
    if moves and after:
        first = moves[0].iteration
        if first in stamps and first - 1 in stamps:
            pause = stamps[first] - stamps[first - 1] - statistics.median(after)
    return after, pause, max((e.move_s for e in moves), default=float("nan"))


def report(runs: list, results: dict[tuple[int, int, int, str], list[Result]]) -> list[str]:
    lines = ["", "case                          ends on                 s/iter   plan  kept planned  bound layers "
                 "pause s move s RSS GB state GB"]
    ff: dict[tuple[int, int, int], tuple[float, float]] = {}
    for s, d, m, case, _costs, parts, failed, layers in runs:
        rs = [x for x in results.get((s, d, m, case.name), []) if x.ok]
        windows = [_window(x) for x in rs]
        times = [t for w in windows for t in w[0]]
        measured = statistics.median(times) if times else float("nan")
        pause = statistics.median(w[1] for w in windows) if windows else float("nan")
        move = statistics.median(w[2] for w in windows) if windows else float("nan")
        planned = make_plan(s, d, m, layers.stage_costs(parts), failed).time_per_iteration / 1e3
        if not case.failed:
            ff.setdefault((s, d, m), (measured, planned))
            if case.name == "failure-free":
                lines.append(f"{s} x {d}, M = {m} (emulated accelerators)")
        f_meas, f_plan = ff.get((s, d, m), (float("nan"), float("nan")))
        bound = (s * d - len(failed)) / (s * d)
        whole = granularity_bound(layers, s, d, failed) if failed else 1.0
        rss = statistics.median(x.peak_rss_gb for x in rs) if rs else float("nan")
        heaviest = max(parts[k + 1] - parts[k] for k in range(s)) * BLOCK_STATE_GB
        lines.append(f"  {case.name:<28}{str(list(parts)):<22}{measured:7.3f}{planned:7.3f}{f_meas / measured:6.3f}"
                     f"{f_plan / planned:8.3f}{bound:7.3f}{whole:7.3f}{pause:8.2f}{move:7.3f}{rss:7.2f}"
                     f"{heaviest:9.1f}")
    lines += ["columns: s/iter measured (median over the timed steps of every round: for a kill, the steps after the "
              "last move or rejoin); plan = the planner's time for that plan; kept = failure-free s/iter / this "
              "(measured); planned = the same from the plans; bound = (S D - lost) / (S D); layers = whole-layer "
              "balance bound against the job's own partition (bubbles not counted; above 'bound' when the job's own "
              "cut is itself uneven); pause s = the moving step's time over the median after it; move s = the "
              "longest layer transfer on any worker; RSS GB = sum over the job's processes (emulated layers hold a few "
              "floats); state GB = the model state of the stage holding the most layers if each were a GPT-3 2.7B "
              "layer (12 h^2 parameters, 16 B each: computed, not measured)"]
    return lines


if __name__ == "__main__":
    sys.exit(main())
