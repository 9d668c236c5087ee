"""This checkout against another git revision on the same job: time per iteration, alternated run by run.

    .venv/bin/python benchmarks/against_revision.py --rev main~1 [--rounds 4] [--steps 30] \
        [--config configs/gpt_cpu_2x2.json] [--measure iteration|job] [--rev-recycle JSON] [--out FILE]

The revision is checked out into a temporary git worktree and run with this checkout's virtual environment (its
``ds_recycle`` first on ``PYTHONPATH``). Each round runs the built-in training script (``launch/train.py``) under
``ds-recycle launch`` on ``--config`` once per checkout, in alternating order, and reads the per-iteration wall
times from the script's metrics file (``--metrics``: ``iter_time_s`` of every iteration) from iteration 6 on.
Reported: the median per checkout and their ratio, with the machine's load. Real compute on CPU, all workers
sharing the cores (not emulated). ``--measure job`` times the whole ``ds-recycle launch`` command instead, from
its start to its exit (start-up, training and leaving: what a test or a short job pays). ``--rev-recycle`` merges a
JSON object into the revision's config's ``recycle`` section: ``--rev HEAD --rev-recycle '{"fail_slow": {"enabled":
false}, "measure_costs": false}'`` measures what the job's measuring of itself costs (the pace exchange and the
decisions it feeds, off on one side; the op clock runs on both).
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 5


def _run(checkout: Path, config: Path, steps: int, workers: int, metrics: Path, whole_job: bool) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(checkout), "WANDB_MODE": "disabled"}
    cmd = [sys.executable, "-m", "ds_recycle", "launch", "--num_accelerators", str(workers), "--master_port", "0",
           str(checkout / "launch" / "train.py"), "--deepspeed_config", str(config), "--steps", str(steps),
           "--metrics", str(metrics)]
    began = time.perf_counter()
    out = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - began
    if out.returncode != 0:
        raise RuntimeError(f"{checkout}: exit {out.returncode}\n{(out.stdout + out.stderr)[-3000:]}")
    if whole_job:
        return [seconds * 1e3]
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r["iter_time_s"] * 1e3 for r in records if r["iter"] >= WARMUP]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rev", required=True, help="the git revision to compare with")
    p.add_argument("--config", default=str(ROOT / "configs" / "gpt_cpu_2x2.json"))
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--measure", choices=("iteration", "job"), default="iteration",
                   help="iteration: ms per iteration from the metrics; job: the whole command's wall time")
    p.add_argument("--rev-recycle", default=None,
                   help="JSON object merged into the revision's config's recycle section (this checkout's is as given)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    config = Path(args.config).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        rev_config = config
        if args.rev_recycle:
            try:
                extra = json.loads(args.rev_recycle)
            except json.JSONDecodeError as e:
                raise SystemExit(f"--rev-recycle {args.rev_recycle!r}: not JSON ({e})") from None
            if not isinstance(extra, dict):
                raise SystemExit(f"--rev-recycle {args.rev_recycle!r}: give a JSON object, such as "
                                 '\'{"fail_slow": {"enabled": false}}\'')
            merged = json.loads(config.read_text())
            merged["recycle"] = {**merged.get("recycle", {}), **extra}
            rev_config = Path(tmp) / f"rev-{config.name}"
            rev_config.write_text(json.dumps(merged))
        other = Path(tmp) / "rev"
        subprocess.run(["git", "worktree", "add", "--detach", str(other), args.rev], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            checkouts = {"this checkout": ROOT, args.rev: other}
            configs = {"this checkout": config, args.rev: rev_config}
            times: dict[str, list[float]] = {name: [] for name in checkouts}
            loads = []
            for r in range(args.rounds):
                order = list(checkouts) if r % 2 == 0 else list(reversed(checkouts))
                for k, name in enumerate(order):
                    metrics = Path(tmp) / f"metrics-{r}-{k}.jsonl"
                    times[name] += _run(checkouts[name], configs[name], args.steps, args.workers, metrics,
                                        args.measure == "job")
                    loads.append(os.getloadavg()[0])
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=ROOT, capture_output=True)
    mine, theirs = (statistics.median(times[name]) for name in checkouts)
    lines = [f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores; load average during the "
             f"runs {min(loads):.1f}-{max(loads):.1f}",
             f"command: {' '.join(['python', *sys.argv])}",
             f"job: launch/train.py, {config.name}, {args.workers} workers under ds-recycle launch, {args.steps} "
             f"steps, {args.rounds} alternated rounds, "
             + ("the whole command, start to exit" if args.measure == "job" else f"iterations {WARMUP + 1}+")
             + " (real compute on CPU, not emulated)"
             + (f"; {args.rev}'s recycle section with {args.rev_recycle}" if args.rev_recycle else ""),
             f"{'checkout':>16} {'ms/' + args.measure + ' (median)':>22} {'samples':>10}",
             f"{'this checkout':>16} {mine:>22.1f} {len(times['this checkout']):>10}",
             f"{args.rev:>16} {theirs:>22.1f} {len(times[args.rev]):>10}",
             f"ratio this / {args.rev}: {mine / theirs:.3f}"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
