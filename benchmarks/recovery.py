"""Time from a worker's death to the first full iteration after it, with its breakdown, and throughput
before, during and after the failure.

    PYTHONPATH=$PWD python benchmarks/recovery.py --kill 1:0@10:backward-input --steps 30

Runs the default 2 x 2 GPT config (``configs/gpt_cpu_2x2.json``) under ``ds-recycle launch`` with default
timeouts, kills one worker with ``--kill`` (SIGKILL), and reads the ``recovered`` event from the reporter's
metrics file: detection (kill -> a survivor raises PeerFailure), agreement, regrouping (the new epoch's
gloo groups), plan lookup (PlanCache), restore (the repair's set-up: partial gradient rows adopted, a
roll-forward if one is needed) and redone work (until the first full iteration under the new plan ends).
Throughput (tokens/s, median per phase) comes from the
same file: iterations before the failure, the iteration that absorbed it, and the iterations after it.

The failing job runs twice, side by side: with salvage of the interrupted iteration (``recycle.salvage``,
the default: the survivors keep the weight gradients they finished) and with ``recycle.salvage: false``
(the stages that had not stepped drop their partial sums and run their part of the iteration again), so the
saving is measured under the same load.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ds_recycle.events import RecoveredEvent, events_of  # noqa: E402

PARTS = ("detection_s", "agreement_s", "regroup_s", "plan_lookup_s", "restore_s", "redo_s")


def run_job(config: Path, steps: int, kill: str | None, workdir: Path, name: str = "") -> list[dict]:
    metrics = workdir / f"metrics-{name or ('kill' if kill else 'clean')}.jsonl"
    cmd = [sys.executable, "-m", "ds_recycle", "launch", "--num_accelerators", "4", "--master_port", "0",
           str(REPO / "launch" / "train.py"), "--deepspeed_config", str(config), "--steps", str(steps),
           "--metrics", str(metrics), "--wandb", "disabled"] + (["--kill", kill] if kill else [])
    job = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    if job.returncode != 0:
        raise SystemExit(f"job failed ({job.returncode}):\n{job.stdout[-3000:]}{job.stderr[-3000:]}")
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def _recovered(records: list[dict]) -> tuple[int, RecoveredEvent]:
    """The iteration whose record carries the first ``recovered`` event, and the event."""
    return next((r["iter"], e) for r in records for e in events_of([r], RecoveredEvent))


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "configs" / "gpt_cpu_2x2.json"))
    p.add_argument("--kill", action="append", default=None,
                   help="P:S@N:PHASE, repeatable (the reporter must survive); default: 1:0@10:backward-input and "
                        "1:0@10:backward-weight")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3, help="runs per kill and mode, alternated (medians reported)")
    args = p.parse_args()
    kills = args.kill or ["1:0@10:backward-input", "1:0@10:backward-weight"]
    print(f"machine: {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"python {platform.python_version()}; config {args.config}; {args.steps} steps; {args.repeats} runs "
          "per kill and mode, alternated; medians")
    tput = lambda rs: _median([r["tokens_per_s"] for r in rs])  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        redo_config = Path(tmp) / "redo.json"
        raw = json.loads(Path(args.config).read_text())
        raw.setdefault("recycle", {})["salvage"] = False
        redo_config.write_text(json.dumps(raw))
        configs = {"salvage": Path(args.config), "redo": redo_config}
        clean = run_job(Path(args.config), args.steps, None, Path(tmp))
        print(f"failure-free run: {tput(clean[1:]):.0f} tokens/s")
        for kill in kills:
            runs: dict[str, list[list[dict]]] = {"salvage": [], "redo": []}
            for n in range(args.repeats):
                for mode in ("salvage", "redo"):
                    runs[mode].append(run_job(configs[mode], args.steps, kill, Path(tmp), f"{mode}{n}"))
            totals = {}
            for mode, jobs in runs.items():
                recs = [_recovered(job) for job in jobs]
                totals[mode] = (_median([e.failure_to_full_iteration_s for _, e in recs]),
                                _median([e.redo_s for _, e in recs]))
                kept = [e.kept_weight_gradients for _, e in recs]
                committed = [list(e.committed_stages) for _, e in recs]
                logged = [e.tensors_from_logs for _, e in recs]
                print(f"[{kill}, {mode}] failure -> first full iteration {totals[mode][0]:.3f} s; weight gradients "
                      f"kept: {kept}; stages that had stepped: {committed}; tensors from boundary logs: {logged}")
                for part in PARTS:
                    values = [v for _, e in recs if (v := getattr(e, part)) is not None]
                    print(f"  {part[:-2]:<12} {_median(values):.4f} s" if values else f"  {part[:-2]:<12} n/a")
                hit, _ = recs[0]
                before = [r for r in jobs[0][1:] if r["iter"] < hit]
                after = [r for r in jobs[0] if r["iter"] > hit]
                print(f"  throughput (first run), tokens/s: before {tput(before):.0f}, after {tput(after):.0f} "
                      f"(after/before {tput(after) / tput(before):.2f})")
            print(f"[{kill}] salvage / redo: failure -> first full iteration "
                  f"{totals['salvage'][0] / totals['redo'][0]:.2f}x, repaired / redone iteration "
                  f"{totals['salvage'][1] / totals['redo'][1]:.2f}x")
    return 0

if __name__ == "__main__":
    sys.exit(main())
