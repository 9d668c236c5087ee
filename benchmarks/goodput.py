"""Goodput over a fixed wall-clock window with several worker failures: ds_recycle against vanilla DeepSpeed
restarting from checkpoints, under the same failures (Linux: worker pids come from /proc).

    PYTHONPATH=$PWD python benchmarks/goodput.py --window 180 --failures 45:1:0,90:1:1,135:0:0 \\
        --restart-delay 5 --checkpoint-interval 5 --out benchmarks/results --name goodput-2026-11-30

Both systems train the same config (default ``configs/gpt_cpu_2x2.json``) for ``--window`` seconds from the
launch of their first process. Each failure is a real SIGKILL, sent from outside, of the process running worker
(pipeline, stage) at the same offset from the launch in both runs (deferred while that process does not exist).

* **ds_recycle**: one ``ds-recycle launch --restart_failed_after R`` job. The survivors re-route the dead
  worker's micro-batches; the launcher restarts the killed worker R s later (it rejoins the job where rejoining
  is built; otherwise it waits for a fallback and leaves). If a failure leaves a stage without a live worker, the
  job falls back to its own latest checkpoint (same ``--checkpoint-interval``) and the launcher restarts every
  rank. At the end of the window the launcher gets SIGTERM.
* **vanilla DeepSpeed**: DeepSpeed's own ``deepspeed`` launcher with ``--vanilla`` (the stock PipelineEngine).
  The first dead worker takes the job down (the launcher stops the others within a second); R s later the job is
  started again with ``--resume`` from its latest checkpoint, paying a fresh start-up and redoing the
  iterations since that checkpoint.

Goodput = iterations the model holds at the end of the window x tokens per iteration / window (see
:mod:`ds_recycle.tools.goodput`). Also reported: failure-free iteration rate (the stretch before the first
failure, checkpoints included), checkpoint cost, failures, restarts, rejoins, iterations lost, the longest
time without progress. A job that stalls for 30 s gets its workers' stacks dumped into its log (SIGUSR1), and
a worker above ``--max-worker-gib`` of memory is stack-dumped and SIGKILLed (reported as a runaway: on a shared
machine the OOM killer might otherwise take someone else's process). Writes
``<name>.txt`` (the table), ``<name>.json`` and ``<name>.png`` (iterations held over time) under ``--out``;
logs, metrics and checkpoints under ``--workdir``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ds_recycle.config import load_config  # noqa: E402
from ds_recycle.events import FailureEvent, RejoinEvent, events_of  # noqa: E402
from ds_recycle.tools.goodput import (  # noqa: E402
    Failure,
    Progress,
    checkpoint_cost,
    fallback_times,
    latest_checkpoint,
    parse_failures,
    progress,
    steady_rate,
)
from ds_recycle.tools.jobs import Kill, Launcher, MetricsTail, TrainJob, Watchdog, rank_of  # noqa: E402

POLL_S = 0.1
BIG_STEPS = 1_000_000


@dataclass
class Run:
    """What one system did in the window."""

    name: str
    started_at: float
    window_s: float
    lives: list[list[dict[str, Any]]] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    job_starts: list[float] = field(default_factory=list)
    restarts: int = 0
    progress: Progress | None = None
    load_avg: tuple[float, float] = (0.0, 0.0)
    watchdog: Watchdog = field(default_factory=Watchdog)
    """Stack dumps of stalls; workers killed for runaway memory (failures the schedule did not plan)."""


class Schedule:
    """The failures still to come, as absolute times; one is due once its time has passed."""

    def __init__(self, failures: list[Failure], t0: float, pipelines: int) -> None:
        self.pending = [(t0 + f.offset_s, rank_of(f.pipeline, f.stage, pipelines)) for f in failures]

    def fire(self, job: TrainJob | None) -> list[Kill]:
        """SIGKILL every due victim that has a live process in ``job`` now; the others stay pending."""
        done, kills = [], []
        for item in self.pending:
            if item[0] <= time.time() and job is not None:
                kill = job.kill_rank(item[1])
                if kill is not None:
                    done.append(item)
                    kills.append(kill)
        self.pending = [p for p in self.pending if p not in done]
        return kills


def _script_args(args: argparse.Namespace, ckpt: Path, metrics: Path, vanilla: bool) -> list[str]:
    return ["--deepspeed_config", args.config, "--steps", str(BIG_STEPS), "--metrics", str(metrics),
            "--wandb", "disabled", "--checkpoint-dir", str(ckpt), "--checkpoint-interval",
            str(args.checkpoint_interval), "--resume", "--log-interval", "20", *(["--vanilla"] if vanilla else [])]


def _read_latest(ckpt: Path) -> int:
    path = ckpt / "latest"
    return latest_checkpoint(path.read_text() if path.is_file() else None)


def _fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def run_recycle(args: argparse.Namespace, failures: list[Failure], shape: tuple[int, int]) -> Run:
    """One ds_recycle job through the window; killed workers restarted after ``--restart-delay``."""
    stages, pipelines = shape
    work = _fresh(Path(args.workdir) / "recycle")
    metrics = work / "metrics.jsonl"
    job = TrainJob.start(Launcher.RECYCLE, stages * pipelines, _script_args(args, work / "ckpt", metrics, False),
                         work / "launcher.log", ["--restart_failed_after", str(args.restart_delay),
                                                 "--max_restarts", "50"])
    with job:
        run = Run("ds_recycle", job.started_at, args.window, job_starts=[job.started_at],
                  watchdog=Watchdog(max_rss_gib=args.max_worker_gib))
        schedule, tail = Schedule(failures, job.started_at, pipelines), MetricsTail(metrics)
        while time.time() < job.started_at + args.window:
            tail.poll()
            run.kills += schedule.fire(job)
            run.watchdog.check(job, tail)
            if not job.running:
                raise SystemExit(f"ds_recycle's launcher exited early ({job.proc.returncode}); see {job.log}")
            time.sleep(POLL_S)
        tail.poll()
        last = tail.last["unix_time"] if tail.last is not None else job.started_at
        alive = job.running and not any(t > last for t in fallback_times(job.output()))  # else: back to checkpoint
        run.load_avg = os.getloadavg()[:2]
    run.lives, run.restarts = tail.lives, job.output().count("restarted rank")
    run.progress = progress(tail.lives, alive, _read_latest(work / "ckpt"))
    return run


def _vanilla_life(args: argparse.Namespace, work: Path, life: int, nproc: int) -> tuple[TrainJob, MetricsTail]:
    metrics = work / f"metrics-life{life}.jsonl"
    job = TrainJob.start(Launcher.DEEPSPEED, nproc, _script_args(args, work / "ckpt", metrics, True),
                         work / f"launcher-life{life}.log")
    return job, MetricsTail(metrics)


def run_vanilla(args: argparse.Namespace, failures: list[Failure], shape: tuple[int, int]) -> Run:
    """Vanilla DeepSpeed through the window: each failure ends the job; R s later it resumes from a checkpoint."""
    stages, pipelines = shape
    work = _fresh(Path(args.workdir) / "vanilla")
    job, tail = _vanilla_life(args, work, 0, stages * pipelines)
    try:
        run = Run("vanilla DeepSpeed", job.started_at, args.window, job_starts=[job.started_at],
                  watchdog=Watchdog(max_rss_gib=args.max_worker_gib))
        end = job.started_at + args.window
        schedule, tails = Schedule(failures, job.started_at, pipelines), [tail]
        while time.time() < end:
            tail.poll()
            kills = schedule.fire(job)
            run.watchdog.check(job, tail)
            if kills or not job.running:
                if not kills:
                    raise SystemExit(f"vanilla's launcher exited without a failure ({job.proc.returncode}); "
                                     f"see {job.log}")
                run.kills += kills
                job.wait(min(60.0, max(0.0, end - time.time())))  # the launcher takes the other workers down
                tail.poll()
                job.stop()
                time.sleep(max(0.0, min(args.restart_delay, end - time.time())))
                if time.time() >= end:
                    job = None
                    break
                job, tail = _vanilla_life(args, work, len(tails), stages * pipelines)
                tails.append(tail)
                run.job_starts.append(job.started_at)
            time.sleep(POLL_S)
        alive = job is not None and job.running
        if job is not None:
            tail.poll()
        run.load_avg = os.getloadavg()[:2]
    finally:
        if job is not None:
            job.stop()
    run.lives = [life for t in tails for life in (t.lives or [[]])]  # a life that recorded nothing counts too
    run.restarts = len(run.job_starts) - 1
    run.progress = progress(run.lives, alive, _read_latest(work / "ckpt"))
    return run


def _summary(run: Run, tokens: int, interval: int) -> dict[str, Any]:
    p = run.progress
    assert p is not None
    first_kill = run.kills[0].time_s if run.kills else None
    rate = steady_rate(run.lives[0], before=first_kill) if run.lives else None
    cost = [c for c in (checkpoint_cost(life, interval) for life in run.lives) if c is not None]
    return {"system": run.name, "window_s": run.window_s, "committed_iterations": p.committed,
            "finished_iterations": p.finished, "lost_iterations": p.lost, "goodput_tokens_per_s": p.committed * tokens
            / run.window_s, "goodput_iterations_per_s": p.committed / run.window_s,
            "failure_free_iterations_per_s": rate,
            "checkpoint_cost_s": sorted(cost)[len(cost) // 2] if cost else None,
            "kills": [{"offset_s": k.time_s - run.started_at, "rank": k.rank, "pid": k.pid} for k in run.kills],
            "job_restarts": len(run.job_starts) - 1 if run.name != "ds_recycle" else p.lives - 1,
            "rank_restarts": run.restarts,
            "failures_detected": len(events_of(run.lives, FailureEvent)),
            "rejoins": len(events_of(run.lives, RejoinEvent)),
            "rejoin_offsets_s": [e.time_s - run.started_at for e in events_of(run.lives, RejoinEvent)],
            "first_iteration_after_start_s": _startups(run), "longest_gap_s": _longest_gap(run),
            "stack_dumps_at_s": [t - run.started_at for t in run.watchdog.stalls],
            "memory_runaways": [f"rank {k.rank} {gib:.1f} GiB at {k.time_s - run.started_at:.0f} s"
                                for k, gib in run.watchdog.runaways], "load_avg_at_end": list(run.load_avg)}


def _longest_gap(run: Run) -> float:
    """Longest time without a finished iteration: between two records of a life, or before the first one."""
    times = sorted([run.started_at, *(r["unix_time"] for life in run.lives for r in life),
                    run.started_at + run.window_s])
    return max(b - a for a, b in zip(times, times[1:]))


def _startups(run: Run) -> list[float]:
    """Seconds from each job (re)start to its first finished iteration (vanilla: one life per start)."""
    lives = run.lives if run.name != "ds_recycle" else run.lives[:1]
    return [life[0]["unix_time"] - start for life, start in zip(lives, run.job_starts) if life]


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    if isinstance(value, list):
        return ", ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in value) or "-"
    return str(value)


ROWS = [("committed iterations at the end", "committed_iterations"), ("iterations finished", "finished_iterations"),
        ("iterations lost (rolled back)", "lost_iterations"), ("goodput, tokens/s", "goodput_tokens_per_s"),
        ("goodput, iterations/s", "goodput_iterations_per_s"),
        ("failure-free iterations/s", "failure_free_iterations_per_s"), ("checkpoint cost, s", "checkpoint_cost_s"),
        ("failures injected", "kills_count"), ("failure offsets, s", "kill_offsets"),
        ("launch to first iteration, s", "first_iteration_after_start_s"),
        ("longest time without progress, s", "longest_gap_s"),
        ("stalls (stack dumps) at, s", "stack_dumps_at_s"),
        ("memory runaways (killed)", "memory_runaways"),
        ("whole-job restarts", "job_restarts"), ("rank restarts by the launcher", "rank_restarts"),
        ("failures detected by survivors", "failures_detected"), ("rejoins", "rejoins"),
        ("rejoin offsets, s", "rejoin_offsets_s"), ("load average (1, 5 min) at end", "load_avg_at_end")]


def report(args: argparse.Namespace, results: list[dict[str, Any]]) -> str:
    for r in results:
        r["kills_count"] = len(r["kills"])
        r["kill_offsets"] = [k["offset_s"] for k in r["kills"]]
    lines = [f"machine: {platform.platform()}, {platform.processor() or platform.machine()}, {os.cpu_count()} "
             f"cores (shared with other work); python {platform.python_version()}",
             f"command: PYTHONPATH=$PWD python benchmarks/goodput.py {' '.join(sys.argv[1:])}",
             f"config {args.config}; window {args.window:g} s; failures (s:pipeline:stage) {args.failures}; "
             f"restart delay {args.restart_delay:g} s; checkpoint every {args.checkpoint_interval} iterations",
             "", f"{'':<34}{results[0]['system']:>24}{results[1]['system']:>24}"]
    for label, key in ROWS:
        lines.append(f"{label:<34}{_fmt(results[0][key]):>24}{_fmt(results[1][key]):>24}")
    a, b = results[0]["goodput_tokens_per_s"], results[1]["goodput_tokens_per_s"]
    lines.append(f"\ngoodput ds_recycle / vanilla: {a / b:.2f}x" if b else "\ngoodput ds_recycle / vanilla: "
                 "vanilla committed nothing")
    return "\n".join(lines)


def held_curve(run: Run) -> tuple[list[float], list[int]]:
    """(seconds since launch, iterations the model holds): each record, and a drop to the resume point when a
    failure ends a vanilla life (one life per job start there)."""
    xs: list[float] = []
    ys: list[int] = []
    for i, life in enumerate(run.lives):
        if i > 0 and i - 1 < len(run.kills) and run.name != "ds_recycle":
            resume = next((later[0]["iter"] for later in run.lives[i:] if later),  # a life that recorded nothing
                          run.progress.committed if run.progress else 0)      # resumed where the next one does
            xs += [run.kills[i - 1].time_s - run.started_at] * 2
            ys += [ys[-1] if ys else 0, resume]
            xs.append(run.job_starts[i] - run.started_at)
            ys.append(resume)
        xs += [r["unix_time"] - run.started_at for r in life]
        ys += [r["iter"] + 1 for r in life]
    return xs, ys


def plot(runs: list[Run], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for run, color in zip(runs, ("tab:blue", "tab:orange")):
        ax.plot(*held_curve(run), color=color, marker=".", ms=3, label=run.name)
        for k in run.kills:
            ax.axvline(k.time_s - run.started_at, color=color, ls="--", lw=0.8)
        for t in run.job_starts[1:]:
            ax.axvline(t - run.started_at, color=color, ls=":", lw=0.8)
        for e in events_of(run.lives, RejoinEvent):
            ax.axvline(e.time_s - run.started_at, color="green", ls="-.", lw=0.8)
    ax.set_xlabel("wall-clock since the job's launch (s)\ndashed: SIGKILL; dotted: vanilla job restarted; "
                  "dash-dot (green): rejoin")
    ax.set_ylabel("iterations the model holds")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "configs" / "gpt_cpu_2x2.json"))
    p.add_argument("--window", type=float, default=180.0, help="wall-clock window per system, s (default 180)")
    p.add_argument("--failures", default="45:1:0,90:1:1,135:0:0",
                   help="SECONDS:PIPELINE:STAGE,... offsets from the launch (default 45:1:0,90:1:1,135:0:0)")
    p.add_argument("--restart-delay", type=float, default=5.0, help="R: seconds before a restart, both systems")
    p.add_argument("--checkpoint-interval", type=int, default=5, help="checkpoint every N iterations, both systems")
    p.add_argument("--max-worker-gib", type=float, default=3.0,
                   help="a worker holding more resident memory is stack-dumped and SIGKILLed (default 3 GiB; a "
                        "healthy worker of the default config holds well under 1 GiB)")
    p.add_argument("--only", choices=("recycle", "vanilla"), default=None, help="run one system only")
    p.add_argument("--out", default=str(REPO / "runs" / "goodput"), help="folder of the table, JSON and PNG")
    p.add_argument("--name", default="goodput", help="file name stem of the outputs")
    p.add_argument("--workdir", default=str(REPO / "runs" / "goodput-work"), help="logs, metrics, checkpoints")
    args = p.parse_args()
    if args.window <= 0 or args.restart_delay < 0 or args.checkpoint_interval < 1:
        p.error(f"--window {args.window} must be > 0, --restart-delay {args.restart_delay} >= 0, "
                f"--checkpoint-interval {args.checkpoint_interval} >= 1")
    return args


def main() -> int:
    args = _parse()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    cfg = load_config(args.config)
    shape = (cfg.recycle.stages, cfg.recycle.pipelines)
    try:
        failures = parse_failures(args.failures, *shape)
    except ValueError as e:
        raise SystemExit(f"goodput.py: {e}") from None
    if failures[-1].offset_s >= args.window:
        raise SystemExit(f"goodput.py: failure at {failures[-1].offset_s:g} s is outside --window {args.window:g}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the jobs' cleanup on SIGTERM too
    tokens = cfg.recycle.pipelines * cfg.micro_batches * cfg.micro_batch_size * cfg.recycle.model.seq_len
    runners = {"recycle": run_recycle, "vanilla": run_vanilla}
    runs = [runners[k](args, failures, shape) for k in runners if args.only in (None, k)]
    results = [_summary(r, tokens, args.checkpoint_interval) for r in runs]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if len(results) == 2:
        text = report(args, results)
        print(text)
        (out / f"{args.name}.txt").write_text(text + "\n")
    (out / f"{args.name}.json").write_text(json.dumps({"args": vars(args), "tokens_per_iteration": tokens,
                                                       "machine": platform.platform(), "cores": os.cpu_count(),
                                                       "started_at": {r.name: r.started_at for r in runs},
                                                       "job_starts": {r.name: r.job_starts for r in runs},
                                                       "results": results,
                                                       "lives": {r.name: r.lives for r in runs}}, indent=1))
    plot(runs, out / f"{args.name}.png", f"{Path(args.config).name}: {len(failures)} SIGKILLs in {args.window:g} s, "
         f"restart delay {args.restart_delay:g} s, checkpoint every {args.checkpoint_interval} iterations")
    print(f"outputs: {out / args.name}.{{txt,json,png}}; logs in {args.workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
