"""The failure demo: a worker is SIGKILLed mid-run and training goes on; vanilla DeepSpeed under the same failure.

    PYTHONPATH=$PWD python launch/failure_demo.py --steps 30 --kill 1:0@12:backward-input --out runs/failure-demo

1. **ds_recycle**: ``ds-recycle launch --restart_failed_after R`` runs the config with ``--kill``: the worker
   SIGKILLs itself in that phase of that iteration, the survivors re-route its micro-batches and keep training,
   and the launcher starts it again R s later: it rejoins the running job with its stage's state from its
   live peer. (Should the launcher still run ``--linger`` s after the final model is saved, it is stopped.)
2. **vanilla DeepSpeed** under DeepSpeed's own ``deepspeed`` launcher, with a checkpoint every
   ``--checkpoint-interval`` iterations. The same worker is SIGKILLed from outside (its pid found through
   /proc: Linux only) at the same point of training: once the reporter has finished iteration N-1, half an
   iteration later. The launcher then takes the whole job down; R s later the job starts again with ``--resume``
   from its latest checkpoint and trains to the end. Its time includes both start-ups, the lost partial
   iteration and the iterations redone since the checkpoint.

With ``--slow P:S@N*F`` (repeatable; ``P:S@M*1`` ends it) both systems also meet a slow worker: an emulated
slow accelerator, whose forward, backward and optimizer step are each followed by ``F - 1`` times their own
duration of sleep from iteration N on. ds_recycle finds it (``SLOW: ...`` as it happens), plans around it and
goes back when it is fast again; vanilla DeepSpeed runs every pipeline at its pace.

Prints a table (time to the final model, iterations lost, failure and rejoin times), writes
``throughput.png`` (tokens/s over wall-clock time, failures, restart and rejoins marked), and checks that both
final models are the same (``ds-recycle compare --rtol 1e-5``).
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ds_recycle.events import (  # noqa: E402
    AgreementEvent,
    RecoveredEvent,
    RejoinEvent,
    SlowWorkerEvent,
    events_of,
    parse_event,
)
from ds_recycle.resilience.faults import parse_fault, parse_slow  # noqa: E402
from ds_recycle.tools.jobs import Kill, Launcher, MetricsTail, TrainJob, Watchdog, rank_of  # noqa: E402

POLL_S = 0.1
JOB_TIMEOUT_S = 900.0


@dataclass
class Side:
    """One system's run: its records (one list per job start), kills, job starts and final model."""

    name: str
    started_at: float
    model: Path
    lives: list[list[dict[str, Any]]] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    job_starts: list[float] = field(default_factory=list)

    @property
    def time_to_model_s(self) -> float:
        return self.model.stat().st_mtime - self.started_at

    def offsets(self, times: list[float]) -> str:
        return ", ".join(f"{t - self.started_at:.1f}" for t in times) or "-"


def _env() -> dict[str, str]:
    return {"WANDB_MODE": os.environ.get("WANDB_MODE", "offline")}


def _show(name: str, records: list[dict[str, Any]]) -> None:
    """One line per finished iteration, and the failure events as they happen (each read through
    :mod:`ds_recycle.events`, which words it)."""
    for rec in records:
        loss = rec.get("loss")
        print(f"  {name:<9} iter {rec['iter']:>3}  loss {loss if loss is None else f'{loss:.4f}'}  "
              f"{rec['iter_time_s']:.2f} s  live {rec.get('live_workers', '?')}  "
              f"re-routed {rec.get('rerouted_microbatches', 0)}", flush=True)
        for event in (parse_event(e) for e in rec.get("events") or []):
            if not isinstance(event, AgreementEvent):
                print(f"  {name:<9}   -> {event.describe()}", flush=True)


def _follow(job: TrainJob, tail: MetricsTail, until: Callable[[], bool], what: str, name: str) -> None:
    """Poll the metrics (printing each iteration) until ``until()`` holds; fail if the launcher exits first or the
    job runs too long. Stalls get a stack dump, a worker with runaway memory is killed (:class:`Watchdog`)."""
    deadline, dog = time.time() + JOB_TIMEOUT_S, Watchdog()
    while not until():
        _show(name, tail.poll())
        dog.check(job, tail)
        if not job.running and not until():
            raise SystemExit(f"{job.launcher.value} exited ({job.proc.returncode}) before {what}; see {job.log}")
        if time.time() > deadline:
            raise SystemExit(f"no {what} after {JOB_TIMEOUT_S:.0f} s; see {job.log}")
        time.sleep(POLL_S)


STALE = ("recycle.jsonl", "vanilla-0.jsonl", "vanilla-1.jsonl", "recycle.pt", "vanilla.pt", "throughput.png")
"""Files of an earlier demo in the same folder, removed before the jobs start."""


def run_recycle(args: argparse.Namespace, common: list[str], out: Path) -> Side:
    side = Side("ds_recycle", 0.0, out / "recycle.pt")
    side.model.unlink(missing_ok=True)
    job = TrainJob.start(Launcher.RECYCLE, args.workers, [*common, "--kill", args.kill, "--save-final",
                                                         str(side.model), "--metrics", str(out / "recycle.jsonl")],
                         out / "recycle.log", ["--restart_failed_after", str(args.restart_failed_after),
                                               "--max_restarts", "1"], _env())
    side.started_at, side.job_starts = job.started_at, [job.started_at]
    tail = MetricsTail(out / "recycle.jsonl")
    with job:
        _follow(job, tail, lambda: f"tensors to {side.model}" in job.output(),
                "the final model", "ds_recycle")
        if job.wait(args.linger) is None:  # e.g. a restarted worker that had not joined when training ended
            print(f"ds_recycle: final model saved; stopping the launcher, still running {args.linger:g} s later")
    tail.poll()
    side.lives = tail.lives
    return side


def _vanilla_job(args: argparse.Namespace, common: list[str], out: Path, life: int, final: bool) -> TrainJob:
    extra = ["--save-final", str(out / "vanilla.pt")] if final else []
    return TrainJob.start(Launcher.DEEPSPEED, args.workers,
                          [*common, "--vanilla", "--checkpoint-dir", str(out / "vanilla-ckpt"),
                           "--checkpoint-interval", str(args.checkpoint_interval), "--resume",
                           "--metrics", str(out / f"vanilla-{life}.jsonl"), *extra],
                          out / f"vanilla-{life}.log", env=_env())


def _kill_in_iteration(job: TrainJob, tail: MetricsTail, iteration: int, rank: int) -> Kill:
    """SIGKILL ``rank`` half an iteration after the reporter finished ``iteration - 1``."""
    _follow(job, tail, lambda: tail.last is not None and tail.last["iter"] >= iteration - 1,
            f"iteration {iteration - 1}", "vanilla")
    times = [r["iter_time_s"] for r in tail.lives[-1][1:]] or [tail.last["iter_time_s"]]  # type: ignore[index]
    time.sleep(0.5 * statistics.median(times))
    kill = job.kill_rank(rank)
    if kill is None:
        raise SystemExit(f"vanilla: rank {rank} has no live process to kill; see {job.log}")
    return kill


def run_vanilla(args: argparse.Namespace, common: list[str], out: Path) -> Side:
    import shutil

    shutil.rmtree(out / "vanilla-ckpt", ignore_errors=True)
    side = Side("vanilla DeepSpeed", 0.0, out / "vanilla.pt")
    side.model.unlink(missing_ok=True)
    fault = parse_fault(args.kill)
    with _vanilla_job(args, common, out, 0, final=False) as job:
        side.started_at, side.job_starts = job.started_at, [job.started_at]
        tail = MetricsTail(out / "vanilla-0.jsonl")
        side.kills.append(_kill_in_iteration(job, tail, fault.iteration, rank_of(fault.pipeline, fault.stage,
                                                                                 args.pipelines)))
        print(f"  vanilla     -> FAILURE: SIGKILL of rank {side.kills[0].rank} (pid {side.kills[0].pid}); "
              "DeepSpeed's launcher ends the job", flush=True)
        job.wait(60.0)  # DeepSpeed's launcher takes the other workers down
        _show("vanilla", tail.poll())
    side.lives = tail.lives
    print(f"  vanilla     -> restarting the whole job from its checkpoint in {args.restart_failed_after:g} s",
          flush=True)
    time.sleep(args.restart_failed_after)
    resumed = MetricsTail(out / "vanilla-1.jsonl")
    with _vanilla_job(args, common, out, 1, final=True) as job:
        side.job_starts.append(job.started_at)
        _follow(job, resumed, lambda: not job.running, "the end of the resumed job", "vanilla")
        code = job.wait(JOB_TIMEOUT_S)
        if code != 0:
            raise SystemExit(f"vanilla's resumed job ended with {code}; see {job.log}")
    _show("vanilla", resumed.poll())
    side.lives += resumed.lives or [[]]
    print(f"vanilla: killed rank {side.kills[0].rank} (pid {side.kills[0].pid}) after iteration "
          f"{side.lives[0][-1]['iter']}; resumed at iteration {side.lives[1][0]['iter'] if side.lives[1] else '?'}")
    return side


def table(args: argparse.Namespace, recycle: Side, vanilla: Side) -> None:
    rejoins = [e.time_s for e in events_of(recycle.lives, RejoinEvent)]
    recovered = events_of(recycle.lives, RecoveredEvent)
    recycle_kills = [e.killed_at for e in recovered if e.killed_at is not None]
    redone_v = vanilla.lives[0][-1]["iter"] + 1 - vanilla.lives[1][0]["iter"]
    print(f"{'system':<22}{'to final model s':>17}{'iterations lost':>19}{'goodput it/s':>14}"
          f"{'failure at s':>14}{'rejoin at s':>13}{'restarted at s':>16}")
    rows = [(recycle, 0, recycle.offsets(recycle_kills),  # the job never rolls back a finished iteration
             recycle.offsets(rejoins), "-"),
            (vanilla, redone_v, vanilla.offsets([k.time_s for k in vanilla.kills]), "-",
             vanilla.offsets(vanilla.job_starts[1:]))]
    for side, redone, fail, rejoin, restart in rows:
        t = side.time_to_model_s
        print(f"{side.name:<22}{t:>17.1f}{redone:>19}{args.steps / t:>14.3f}{fail:>14}{rejoin:>13}{restart:>16}")
    for rec in recovered:
        print(f"ds_recycle: failure -> first full iteration {rec.failure_to_full_iteration_s:.3f} s "
              f"({rec.repair_summary()})")
    for spec in args.slow:
        (pipeline, stage), iteration, factor = parse_slow(spec)
        print(f"slow accelerator injected in both systems: worker ({pipeline}, {stage}) x{factor:g} from iteration "
              f"{iteration} (emulated: sleep after each compute instruction)")
    for event in events_of(recycle.lives, SlowWorkerEvent):
        print(f"ds_recycle at iteration {event.iteration}: {event.describe()}")
    print("times are seconds since each job's launch; 'iterations lost' counts finished iterations rolled back "
          "(vanilla: to its checkpoint, and its partial iteration is lost too)")


def plot(args: argparse.Namespace, sides: list[Side], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for side, color in zip(sides, ("tab:blue", "tab:orange")):
        for i, life in enumerate(side.lives):
            ax.plot([r["unix_time"] - side.started_at for r in life], [r["tokens_per_s"] or 0.0 for r in life],
                    color=color, marker=".", label=side.name if i == 0 else None)
        kills = [k.time_s for k in side.kills] or [e.killed_at for e in events_of(side.lives, RecoveredEvent)
                                                    if e.killed_at is not None]
        for t in kills:
            ax.axvline(t - side.started_at, color=color, ls="--", lw=1, label=f"{side.name}: worker killed")
    for t in sides[1].job_starts[1:]:
        ax.axvline(t - sides[1].started_at, color="gray", ls=":", label="vanilla restarted from its checkpoint")
    for i, e in enumerate(events_of(sides[0].lives, RejoinEvent)):
        ax.axvline(e.time_s - sides[0].started_at, color="green", ls="-.", label="ds_recycle: rejoin" if i == 0
                   else None)
    ax.set_xlabel("wall-clock time since the job's launch (s)")
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=8)
    ax.set_title(f"{Path(args.config).name}: worker {args.kill.split('@')[0]} SIGKILLed in iteration "
                 f"{parse_fault(args.kill).iteration}; restart after {args.restart_failed_after:g} s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "configs" / "gpt_cpu_2x2.json"))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--kill", default="1:0@12:backward-input", help="P:S@N:PHASE (keep the reporter, 0:last, alive)")
    p.add_argument("--checkpoint-interval", type=int, default=5, help="vanilla's checkpoint period (iterations)")
    p.add_argument("--restart_failed_after", "--restart-failed-after", type=float, default=5.0,
                   help="seconds before the killed worker (ds_recycle) or the job (vanilla) is started again")
    p.add_argument("--linger", type=float, default=10.0,
                   help="seconds ds_recycle's launcher may run on after the final model is saved")
    p.add_argument("--slow", action="append", default=[], metavar="P:S@N*F",
                   help="both systems: worker (P, S) runs F times as long from iteration N on (emulated slow "
                        "accelerator; repeatable, F=1 ends it)")
    p.add_argument("--out", default=str(REPO / "runs" / "failure-demo"))
    args = p.parse_args()
    for spec in args.slow:
        try:
            parse_slow(spec)
        except ValueError as err:
            p.error(f"--slow: {err}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    from ds_recycle.config import load_config

    cfg = load_config(args.config)
    args.pipelines, args.workers = cfg.recycle.pipelines, cfg.recycle.pipelines * cfg.recycle.stages
    fault = parse_fault(args.kill)
    if (fault.pipeline, fault.stage) == (0, cfg.recycle.stages - 1) or not 0 < fault.iteration < args.steps:
        p.error(f"--kill {args.kill}: keep worker (0, {cfg.recycle.stages - 1}) alive (it reports) and kill in "
                f"an iteration between 1 and {args.steps - 1}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in STALE:  # a previous demo's metrics would be read as this one's progress
        (out / name).unlink(missing_ok=True)
    common = ["--deepspeed_config", args.config, "--steps", str(args.steps),
              *(part for spec in args.slow for part in ("--slow", spec))]
    recycle = run_recycle(args, common, out)
    vanilla = run_vanilla(args, common, out)
    table(args, recycle, vanilla)
    cmp = subprocess.run([sys.executable, "-m", "ds_recycle", "compare", str(recycle.model), str(vanilla.model),
                          "--rtol", "1e-5"], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    print("final parameters, ds_recycle vs vanilla:", (cmp.stdout.strip().splitlines() or ["?"])[-1])
    plot(args, [recycle, vanilla], out / "throughput.png")
    print(f"plot: {out / 'throughput.png'}; logs and metrics in {out}")
    return 0 if cmp.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
