"""The failure demo: a worker is SIGKILLed mid-run and training goes on; vanilla DeepSpeed under the same failure.

    PYTHONPATH=$PWD python launch/failure_demo.py --steps 30 --kill 1:0@12:backward-input --out runs/failure-demo

1. **ds_recycle**: ``ds-recycle launch`` runs the config with ``--kill``; the survivors re-route the dead
   worker's micro-batches and keep training (metrics with the failure events in ``recycle.jsonl``).
2. **vanilla DeepSpeed** with periodic checkpoints (``--checkpoint-interval``): its job dies with the worker
   (the `deepspeed` launcher stops every rank), and is started again from the latest checkpoint. The first
   run stops at the failure iteration (the kill is placed at that iteration's start, which favours vanilla:
   no detection delay, no partial iteration lost); the second resumes with ``--resume``. Its wall-clock
   includes both start-ups and the iterations redone since the checkpoint.

Prints a table (wall-clock, iterations lost, goodput) and writes ``throughput.png``: tokens/s over wall-clock
time for both, with the failure and the restart marked. Final parameters of both runs are compared.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _launch(args: list[str], out: Path, name: str) -> tuple[float, list[dict]]:
    metrics = out / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "ds_recycle", "launch", "--num_accelerators", "4", "--master_port", "0",
           str(REPO / "launch" / "train.py"), *args, "--metrics", str(metrics)]
    start = time.time()
    job = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800,
                         env={**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": os.environ.get("WANDB_MODE",
                                                                                                  "offline")})
    (out / f"{name}.log").write_text(job.stdout + job.stderr)
    if job.returncode != 0:
        raise SystemExit(f"{name} failed ({job.returncode}); see {out / f'{name}.log'}")
    return start, [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def _timeline(start: float, records: list[dict]) -> list[tuple[float, float]]:
    """(seconds since ``start``, tokens/s) at the end of each iteration."""
    return [(r["unix_time"] - start, r["tokens_per_s"] or 0.0) for r in records]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "configs" / "gpt_cpu_2x2.json"))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--kill", default="1:0@12:backward-input", help="P:S@N:PHASE (keep the reporter, 0:last, alive)")
    p.add_argument("--checkpoint-interval", type=int, default=5, help="vanilla's checkpoint period (iterations)")
    p.add_argument("--out", default=str(REPO / "runs" / "failure-demo"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fail_at = int(args.kill.split("@")[1].split(":")[0])
    common = ["--deepspeed_config", args.config, "--steps", str(args.steps)]

    t0, recycle = _launch(common + ["--kill", args.kill, "--save-final", str(out / "recycle.pt")], out, "recycle")
    t_recycle = time.time() - t0
    ck = out / "vanilla-ckpt"
    v0, first = _launch(["--deepspeed_config", args.config, "--steps", str(fail_at), "--vanilla", "--checkpoint-dir",
                         str(ck), "--checkpoint-interval", str(args.checkpoint_interval)], out, "vanilla-until-failure")
    v1, second = _launch(common + ["--vanilla", "--checkpoint-dir", str(ck), "--resume",
                                   "--save-final", str(out / "vanilla.pt")], out, "vanilla-restarted")
    t_vanilla = time.time() - v0
    resumed_at = second[0]["iter"]

    events = [e for r in recycle for e in r["events"]]
    rec = next((e for e in events if e["kind"] == "recovered"), None)
    print(f"{'system':<22}{'wall-clock s':>13}{'iterations redone':>19}{'goodput it/s':>14}")
    print(f"{'ds_recycle':<22}{t_recycle:>13.1f}{1:>19}{args.steps / t_recycle:>14.3f}")
    print(f"{'vanilla + checkpoint':<22}{t_vanilla:>13.1f}{fail_at - resumed_at:>19}{args.steps / t_vanilla:>14.3f}")
    if rec:
        print(f"ds_recycle: failure -> first full iteration {rec['failure_to_full_iteration_s']:.3f} s")
    cmp = subprocess.run([sys.executable, "-m", "ds_recycle", "compare", str(out / "recycle.pt"),
                          str(out / "vanilla.pt"), "--rtol", "1e-5"], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    print("final parameters, ds_recycle vs vanilla:", cmp.stdout.strip().splitlines()[-1])

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    r_line = _timeline(t0, recycle)
    ax.plot(*zip(*r_line), label="ds_recycle", marker=".")
    ax.plot(*zip(*_timeline(v0, first)), color="tab:orange", marker=".",
            label="vanilla DeepSpeed + checkpoint restart")
    ax.plot(*zip(*_timeline(v0, second)), color="tab:orange", marker=".")
    kill_t = next((e["killed_at"] for e in events if e["kind"] == "recovered" and e.get("killed_at")), None)
    if kill_t:
        ax.axvline(kill_t - t0, color="red", ls="--", label=f"worker killed (iteration {fail_at})")
    ax.axvline(v1 - v0, color="gray", ls=":", label=f"vanilla restarted (resumes at iteration {resumed_at})")
    ax.set_xlabel("wall-clock time since the job's launch (s)")
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=8)
    ax.set_title(f"{Path(args.config).name}: one worker SIGKILLed at iteration {fail_at}")
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=120)
    print(f"plot: {out / 'throughput.png'}; logs and metrics in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
