"""Time from a worker's death to the first full iteration after it, with its breakdown, and throughput
before, during and after the failure.

    PYTHONPATH=$PWD python benchmarks/recovery.py --kill 1:0@10:backward-input --steps 30

Runs the default 2 x 2 GPT config (``configs/gpt_cpu_2x2.json``) under ``ds-recycle launch`` with default
timeouts, kills one worker with ``--kill`` (SIGKILL), and reads the ``recovered`` event from the reporter's
metrics file: detection (kill -> a survivor raises PeerFailure), agreement, regrouping (the new epoch's
gloo groups), plan lookup (PlanCache), restore (snapshot of the redone iteration) and redone work (until
the first full iteration under the new plan ends). Throughput (tokens/s, median per phase) comes from the
same file: iterations before the failure, the iteration that absorbed it, and the iterations after it.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARTS = ("detection_s", "agreement_s", "regroup_s", "plan_lookup_s", "restore_s", "redo_s")


def run_job(config: Path, steps: int, kill: str | None, workdir: Path) -> list[dict]:
    metrics = workdir / f"metrics-{'kill' if kill else 'clean'}.jsonl"
    cmd = [sys.executable, "-m", "ds_recycle", "launch", "--num_accelerators", "4", "--master_port", "0",
           str(REPO / "launch" / "train.py"), "--deepspeed_config", str(config), "--steps", str(steps),
           "--metrics", str(metrics), "--wandb", "disabled"] + (["--kill", kill] if kill else [])
    job = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
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
        clean = run_job(Path(args.config), args.steps, None, Path(tmp))
        failed = run_job(Path(args.config), args.steps, args.kill, Path(tmp))
    rec = next(e for r in failed for e in r["events"] if e["kind"] == "recovered")
    hit = next(r["iter"] for r in failed if any(e["kind"] == "recovered" for e in r["events"]))
    tput = lambda rs: statistics.median(r["tokens_per_s"] for r in rs) if rs else float("nan")  # noqa: E731
    before = [r for r in failed[1:] if r["iter"] < hit]
    after = [r for r in failed if r["iter"] > hit]
    print(f"machine: {platform.node()} {platform.processor() or platform.machine()}, "
          f"python {platform.python_version()}; config {args.config}; kill {args.kill}; {args.steps} steps")
    print(f"failure -> first full iteration: {rec['failure_to_full_iteration_s']:.3f} s (redo of iteration "
          f"{rec['redo_iteration']})")
    for part in PARTS:
        value = rec.get(part)
        print(f"  {part[:-2]:<12} {value:.4f} s" if value is not None else f"  {part[:-2]:<12} n/a")
    print(f"throughput, tokens/s (median): failure-free run {tput(clean[1:]):.0f}; with the failure: before "
          f"{tput(before):.0f}, iteration {hit} (absorbed it) {failed[hit]['tokens_per_s']:.0f}, "
          f"after {tput(after):.0f} (after/before {tput(after) / tput(before):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
