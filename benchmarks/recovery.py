"""Time from a worker's death to the first full iteration after it, with its breakdown, and throughput
before, during and after the failure.

    PYTHONPATH=$PWD python benchmarks/recovery.py --kill 1:0@10:backward-input --steps 30

Runs the default 2 x 2 GPT config (``configs/gpt_cpu_2x2.json``) under ``ds-recycle launch`` with default
timeouts, kills one worker with ``--kill`` (SIGKILL), and reads the ``recovered`` event from the reporter's
metrics file: detection (kill -> a survivor raises PeerFailure), agreement, regrouping (the new epoch's
gloo groups), plan lookup (PlanCache), restore (snapshot of the redone iteration) and redone work (until
the first full iteration under the new plan ends). Throughput (tokens/s, median per phase) comes from the
same file: iterations before the failure, the iteration that absorbed it, and the iterations after it.

The failing job runs twice, side by side: with salvage of the interrupted iteration (``recycle.salvage``,
the default: the survivors keep the weight gradients they finished) and with ``recycle.salvage: false``
(the iteration is redone from its snapshot), so the saving is measured under the same load.
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "configs" / "gpt_cpu_2x2.json"))
    p.add_argument("--kill", default="1:0@10:backward-input", help="P:S@N:PHASE (the reporter must survive)")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        redo_config = Path(tmp) / "redo.json"
        raw = json.loads(Path(args.config).read_text())
        raw.setdefault("recycle", {})["salvage"] = False
        redo_config.write_text(json.dumps(raw))
        clean = run_job(Path(args.config), args.steps, None, Path(tmp))
        runs = {"salvage": run_job(Path(args.config), args.steps, args.kill, Path(tmp), "salvage"),
                "redo": run_job(redo_config, args.steps, args.kill, Path(tmp), "redo")}
    print(f"machine: {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"python {platform.python_version()}; config {args.config}; kill {args.kill}; {args.steps} steps")
    tput = lambda rs: statistics.median(r["tokens_per_s"] for r in rs) if rs else float("nan")  # noqa: E731
    print(f"failure-free run: {tput(clean[1:]):.0f} tokens/s (median)")
    recs = {}
    for mode, failed in runs.items():
        rec = recs[mode] = next(e for r in failed for e in r["events"] if e["kind"] == "recovered")
        hit = next(r["iter"] for r in failed if any(e["kind"] == "recovered" for e in r["events"]))
        before = [r for r in failed[1:] if r["iter"] < hit]
        after = [r for r in failed if r["iter"] > hit]
        how = (f"salvaged, {rec.get('kept_weight_gradients', 0)} weight gradients kept" if rec.get("salvaged")
               else f"redone: {rec.get('redo_reason') or 'salvage off'}")
        print(f"[{mode}] failure -> first full iteration: {rec['failure_to_full_iteration_s']:.3f} s "
              f"(iteration {rec['redo_iteration']} {how})")
        for part in PARTS:
            value = rec.get(part)
            print(f"  {part[:-2]:<12} {value:.4f} s" if value is not None else f"  {part[:-2]:<12} n/a")
        print(f"  throughput, tokens/s (median): before {tput(before):.0f}, iteration {hit} (absorbed it) "
              f"{failed[hit]['tokens_per_s']:.0f}, after {tput(after):.0f} (after/before "
              f"{tput(after) / tput(before):.2f})")
    s_rec, r_rec = recs["salvage"], recs["redo"]
    print(f"salvage / redo: failure -> first full iteration {s_rec['failure_to_full_iteration_s'] / "
          f"r_rec['failure_to_full_iteration_s']:.2f}x, repaired / redone iteration "
          f"{s_rec['redo_s'] / r_rec['redo_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
