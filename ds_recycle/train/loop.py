"""``launch/train.py``: train the GPT from a DeepSpeed JSON config, with DeepSpeed's engine or ds_recycle's.

    ds-recycle launch --num_accelerators 4 launch/train.py --deepspeed_config configs/gpt_cpu_2x2.json \\
        --steps 30 --metrics runs/m.jsonl --save-final runs/final.pt
    deepspeed --num_accelerators 4 launch/train.py --deepspeed_config configs/gpt_cpu_2x2.json --vanilla
    torchrun --nproc_per_node 4 launch/train.py --deepspeed_config configs/gpt_cpu_2x2.json --vanilla
    python launch/train.py --deepspeed_config configs/gpt_cpu_2x2.json --dry-run   # check the config only

Only ``ds-recycle launch`` keeps survivors alive when a worker dies; under the other launchers the
script trains the same model but a failure ends the job.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ds_recycle.config import ConfigError, TrainConfig, load_config
from ds_recycle.events import Event
from ds_recycle.resilience.world import World, init_worker
from ds_recycle.train.runner import Runner

logger = logging.getLogger("ds_recycle.train")

if TYPE_CHECKING:
    from ds_recycle.launcher.hostwatch import HostEvents

__all__ = ["main", "parse_args"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="train.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON config with a 'recycle' section")
    p.add_argument("--steps", type=int, default=30, help="iterations to train (default 30)")
    p.add_argument("--metrics", default=None, help="JSON Lines file, one record per iteration")
    p.add_argument("--save-final", dest="save_final", default=None,
                   help="torch.save the whole model's final parameters, by name, to this file")
    p.add_argument("--checkpoint-dir", dest="checkpoint_dir", default=None,
                   help="directory of periodic DeepSpeed checkpoints (with the data position)")
    p.add_argument("--checkpoint-interval", dest="checkpoint_interval", type=int, default=0,
                   help="save a checkpoint every N iterations (0: never)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir, if there is one")
    p.add_argument("--kill", action="append", default=[], metavar="P:S@N:PHASE",
                   help="inject a failure: SIGKILL worker (pipeline P, stage S) when it enters PHASE of iteration N "
                        "(forward, backward-input, backward-weight, send, receive, all-reduce, optimizer-step, idle); "
                        "repeatable; adds to recycle.faults")
    p.add_argument("--slow", action="append", default=[], metavar="P:S@N*F",
                   help="inject a slow accelerator: from iteration N on, worker (pipeline P, stage S) runs its F, B, W "
                        "and optimizer step F times as long (CPU); repeatable; adds to recycle.faults")
    p.add_argument("--costs-out", dest="costs_out", default=None,
                   help="after training, write the F/B/W/O costs per stage the job measured (the planner's "
                        "costs-file format, seconds: recycle.costs_file reads it) and log how the plan fares under "
                        "them against the measured iteration")
    p.add_argument("--vanilla", action="store_true", help="run DeepSpeed's stock PipelineEngine (the baseline)")
    p.add_argument("--wandb", choices=("offline", "online", "disabled"), default=None,
                   help="wandb mode (default: $WANDB_MODE, else offline)")
    p.add_argument("--run-name", default=None, help="wandb run name")
    p.add_argument("--log-interval", type=int, default=5, help="progress line every N iterations on the reporter")
    p.add_argument("--dry-run", action="store_true", help="validate the config, print it resolved, start nothing")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by `deepspeed`
    p.add_argument("--deepspeed", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps {args.steps}: train at least one iteration")
    if (args.checkpoint_interval or args.resume) and not args.checkpoint_dir:
        p.error("--checkpoint-interval/--resume need --checkpoint-dir DIR")
    from ds_recycle.resilience.faults import parse_fault, parse_slow

    for text in args.kill:
        try:
            parse_fault(text)
        except ValueError as e:
            p.error(f"--kill: {e}")
    for text in args.slow:
        try:
            parse_slow(text)
        except ValueError as e:
            p.error(f"--slow: {e}")
    if args.checkpoint_interval < 0:
        p.error(f"--checkpoint-interval {args.checkpoint_interval}: use 0 (never) or a positive number")
    return args


def _configure_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", force=True)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def _load(args: argparse.Namespace) -> TrainConfig:
    cfg = load_config(args.deepspeed_config)
    if args.kill or args.slow:
        cfg = _with_kills(cfg, args.kill, args.slow)
    if args.vanilla and cfg.recycle.enabled:
        from dataclasses import replace

        cfg = replace(cfg, recycle=replace(cfg.recycle, enabled=False))
    return cfg


def _with_kills(cfg: TrainConfig, kills: Sequence[str], slows: Sequence[str] = ()) -> TrainConfig:
    """``cfg`` with the ``--kill`` and ``--slow`` faults appended to ``recycle.faults`` (checked like config
    entries)."""
    from dataclasses import replace

    from ds_recycle.config import FaultConfig
    from ds_recycle.resilience.faults import parse_fault, parse_slow

    added = []
    for text in kills:
        f = parse_fault(text)
        added.append(FaultConfig((f.pipeline, f.stage), f.iteration, f.phase.value))
    for text in slows:
        worker, iteration, factor = parse_slow(text)
        added.append(FaultConfig(worker, iteration, slow=factor))
    return replace(cfg, recycle=replace(cfg.recycle, faults=cfg.recycle.faults + tuple(added)))


def main(argv: Sequence[str] | None = None) -> int:
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 <pid>`: every thread's Python stack to stderr, for hangs
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    args = parse_args(argv)
    _configure_logging(int(os.environ.get("RANK", "0")))
    try:
        cfg = _load(args)
        if args.dry_run:
            print(json.dumps(cfg.resolved(), indent=2))
            return 0
        if "WORLD_SIZE" in os.environ:
            cfg.check_world_size(int(os.environ["WORLD_SIZE"]))
    except ConfigError as e:
        # Every worker reads the same file: under a launcher the error is printed by rank 0 only.
        (logger.error if int(os.environ.get("RANK", "0")) == 0 else logger.debug)("%s", e)
        return 2
    return _train(cfg, args)


class _HostEventFeed:
    """The launchers' host events (lost, partitioned, back) for the reporter's metrics; nothing without them.

    A reporter that takes over from a dead one starts at the events recorded so far (the dead one had them).
    """

    def __init__(self, takeover: bool) -> None:
        self._events: HostEvents | None = None
        if os.environ.get("DS_RECYCLE_LAUNCHER") != "1" or not os.environ.get("DS_RECYCLE_STORE"):
            return
        from ds_recycle.launcher.hostwatch import HostEvents
        from ds_recycle.resilience.store import connect_store

        try:
            self._events = HostEvents(connect_store(30.0))
            if takeover:
                self._events.drain()
        except (RuntimeError, OSError) as err:
            logger.warning("host events are not reported: the launcher's store cannot be read (%s)", err)
            self._events = None

    def drain(self) -> list[Event]:
        if self._events is None:
            return []
        try:
            return list(self._events.drain())
        except (RuntimeError, OSError, ValueError) as err:
            logger.warning("could not read the host events: %s", err)
            return []


def _train(cfg: TrainConfig, args: argparse.Namespace) -> int:
    from ds_recycle.train.metrics import MetricsWriter

    world = init_worker()
    cfg.check_world_size(world.world_size)
    logger.info("rank %d of %d on %s", world.rank, world.world_size, _device_text())
    runner = _make_runner(cfg, world)
    if hasattr(runner, "fallback_directory"):  # a whole lost stage falls back to this directory's checkpoint
        runner.fallback_directory = args.checkpoint_dir
    continued = _continues_a_record(runner, args)
    tokens = cfg.recycle.pipelines * cfg.micro_batches * cfg.micro_batch_size * cfg.recycle.model.seq_len

    def open_metrics(takeover: bool) -> MetricsWriter:
        if takeover:
            logger.warning("the reporting worker is gone: this rank reports from now on (appending to %s)",
                           args.metrics)
        elif continued:
            logger.info("resuming: appending to %s", args.metrics)
        else:
            logger.info("resolved config: %s", json.dumps(cfg.resolved()))
        return MetricsWriter(args.metrics, tokens, cfg.resolved(), args.wandb or os.environ.get("WANDB_MODE",
                             "offline"), run_name=args.run_name, append=continued, takeover=takeover)

    metrics = open_metrics(False) if runner.is_reporter() else None
    hosts = _HostEventFeed(takeover=False) if metrics is not None else None
    start = _resume(runner, args)  # a restarted worker that joined the running job catches up inside the engine
    first_loss = last_loss = None
    for it in range(start, args.steps):
        t0 = time.perf_counter()
        result = runner.train_iteration(it)
        if it == args.steps - 1:  # the last step made final: a member lost meanwhile is this record's event
            result = replace(result, events=result.events + runner.finish(keep_final_state=args.save_final is not None))
        dt = time.perf_counter() - t0
        if metrics is None and runner.is_reporter():  # the reporter died and this rank took over
            metrics = open_metrics(True)
            hosts = _HostEventFeed(takeover=True)
        if metrics is not None:
            rec = metrics.record(it, result, dt, hosts.drain() if hosts is not None else ())
            first_loss = result.loss if first_loss is None else first_loss
            last_loss = result.loss
            if rec is not None and (it % args.log_interval == 0 or it == args.steps - 1):
                logger.info("iter %d/%d loss %.4f %.0f ms %.0f tokens/s live %d rerouted %d", it + 1, args.steps,
                            result.loss or float("nan"), dt * 1e3, rec["tokens_per_s"] or 0.0,
                            result.live_workers, result.rerouted_microbatches)
        if args.checkpoint_interval and (it + 1) % args.checkpoint_interval == 0 and it + 1 < args.steps:
            runner.save_checkpoint(args.checkpoint_dir, it + 1)
    if args.costs_out:
        _write_costs(runner, args.costs_out)
    state = runner.gather_final_state() if args.save_final else None
    if state is not None:
        import torch

        torch.save(state, args.save_final)
        logger.info("saved %d tensors to %s", len(state), args.save_final)
    if metrics is not None:
        metrics.close({"first_loss": first_loss, "final_loss": last_loss})
    runner.close()
    return 0


def _write_costs(runner: Runner, path: str) -> None:
    """The measured costs to ``path`` (on the reporter), and the plan's time under them beside the measured one."""
    report = runner.measured_costs()
    if report is None:
        logger.warning("no costs measured (DeepSpeed's engine, or a GPU, where instructions are not timed yet): "
                       "%s not written", path)
        return
    if not runner.is_reporter():
        return
    Path(path).write_text(json.dumps({**report.costs.to_json(), "units": "s", "source": "measured by the job"},
                                     indent=2) + "\n")
    measured = "none complete" if report.measured_s is None else f"{report.measured_s * 1e3:.1f} ms"
    ratio = "" if report.measured_s is None else f" (measured / planned {report.measured_s / report.planned_s:.3f})"
    logger.info("measured costs per stage (ms): F %s B %s W %s O %s; the plan's iteration under them %.1f ms, "
                "measured %s%s; written to %s", *(_ms(getattr(report.costs, k)) for k in ("F", "B", "W", "O")),
                report.planned_s * 1e3, measured, ratio, path)


def _ms(values: tuple[float, ...]) -> str:
    return "[" + " ".join(f"{v * 1e3:.2f}" for v in values) + "]"


def _continues_a_record(runner: Runner, args: argparse.Namespace) -> bool:
    """Whether this run continues an earlier one (``--resume``, or a restart after a fallback to the checkpoint):
    its metrics are appended to the same file, so that it keeps one record."""
    return bool(args.resume) or runner.generation > 0


def _resume(runner: Runner, args: argparse.Namespace) -> int:
    """The first iteration to run: 0, or the data position saved with the latest checkpoint (with ``--resume``,
    and in a job restarted by a fallback to its checkpoint, which needs no ``--resume``)."""
    if not _continues_a_record(runner, args) or not args.checkpoint_dir:
        return 0
    start = runner.load_checkpoint(args.checkpoint_dir)
    if start is None:
        logger.info("no checkpoint in %s: starting at iteration 0", args.checkpoint_dir)
        return 0
    logger.info("resumed from %s at iteration %d", args.checkpoint_dir, start)
    return start


def _device_text() -> str:
    """Where this worker computes, for the log: ``cpu``, or ``cuda:<i> (<name>), shared by <n> workers``."""
    import torch

    from ds_recycle.resilience.accelerator import workers_per_gpu

    if not torch.cuda.is_available():
        return "cpu"
    index = torch.cuda.current_device()
    sharing = workers_per_gpu()
    return (f"cuda:{index} ({torch.cuda.get_device_name(index)})"
            + (f", shared by {sharing} workers (gloo through host memory)" if sharing > 1 else ""))


def _make_runner(cfg: TrainConfig, world: World) -> Runner:
    if not cfg.recycle.enabled:
        from ds_recycle.train.vanilla import VanillaRunner

        return VanillaRunner(cfg, world)
    if cfg.recycle.faults and not world.resilient:
        logger.warning("recycle.faults is set but this launcher does not keep survivors alive: use ds-recycle launch")
    from ds_recycle.train.recycle import EngineRunner

    return EngineRunner(cfg, world)


if __name__ == "__main__":
    sys.exit(main())
