"""Periodic per-stage checkpoints of the ReCycle engine, and the generation a restarted job joins.

Layout: ``<dir>/iter<N>/stage<S>.pt`` (parameters, optimizer state, learning-rate schedule, step counters
of stage ``S`` when iteration ``N`` is next) and ``<dir>/latest`` (the text ``iter<N>``, written last, by
one rank, once every stage's file is complete). ``N`` is the data position: data is a pure function of
(iteration, pipeline, micro-batch), so resuming at ``N`` neither skips nor repeats a sample.

When every worker of a stage is lost, the survivors cannot re-route: they record a fallback, bump the job's
*generation* in the launcher's store and leave as lost workers (exit code 75); with
``--restart_failed_after`` the launcher starts every rank again. A restarted process builds its WORLD under
the store prefix of the current generation (the old world's keys are still in the store) and resumes from
the latest checkpoint. A rank restarted while the others train on (its stage kept a live replica) joins the
running job instead (:mod:`ds_recycle.resilience.rejoin`).
"""
from __future__ import annotations

import enum
import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ds_recycle.runtime.job_store import GENERATION_ENV, GENERATION_KEY, begin_resilient_start_up, is_etcd

__all__ = ["GENERATION_KEY", "LOST_EXIT_CODE", "WorldStart", "init_generation_world", "load_stage", "save_stage", "write_latest"]

logger = logging.getLogger(__name__)

"""Store counter: how many times the whole job fell back to a checkpoint."""
LOST_EXIT_CODE = int(os.environ.get("DS_RECYCLE_LOST_EXIT_CODE", "75"))


class WorldStart(enum.Enum):
    """How a worker process enters the job (see :func:`init_generation_world`)."""

    FRESH = "fresh"
    GENERATION = "generation"
    REJOIN = "rejoin"


def _stage_file(directory: str, iteration: int, stage: int) -> Path:
    return Path(directory) / f"iter{iteration}" / f"stage{stage}.pt"


def save_stage(engine: Any, directory: str, next_iteration: int) -> None:
    """Write this stage's state for resuming at ``next_iteration`` (one replica per stage calls it)."""
    path = _stage_file(directory, next_iteration, engine.stage_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    sched = engine.lr_scheduler
    state = {"module": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict(),
             "lr_scheduler": sched.state_dict() if sched is not None else None, "global_steps": engine.global_steps,
             "global_samples": engine.global_samples, "next_iteration": next_iteration}
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def write_latest(directory: str, next_iteration: int) -> None:
    tmp = Path(directory) / "latest.tmp"
    tmp.write_text(f"iter{next_iteration}")
    os.replace(tmp, Path(directory) / "latest")


def load_stage(engine: Any, directory: str) -> int | None:
    """Load this stage's state from the latest checkpoint; the iteration to resume at (None: no checkpoint)."""
    latest = Path(directory) / "latest"
    if not latest.is_file():
        return None
    iteration = int(latest.read_text().strip().removeprefix("iter"))
    path = _stage_file(directory, iteration, engine.stage_id)
    if not path.is_file():
        raise RuntimeError(f"checkpoint {latest} names iteration {iteration}, but {path} is missing")
    state = torch.load(path, weights_only=False)
    engine.module.load_state_dict(state["module"])
    engine.optimizer.load_state_dict(state["optimizer"])
    if state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    engine.global_steps, engine.global_samples = state["global_steps"], state["global_samples"]
    engine.iteration = iteration
    return iteration


def init_generation_world(timeout_s: float) -> WorldStart:
    """Initialise WORLD for this process under ``ds-recycle launch``, or say why not.

    - generation 0, first process of the rank: nothing done, the usual env:// start-up applies (``FRESH``), but
      on an etcd store (``--store etcd://...``), where WORLD is initialised over it like a later generation's;
    - the job fell back to a checkpoint since this rank last ran: WORLD is initialised under the current
      generation's store prefix (``GENERATION``);
    - the rank was restarted while the job trains on without it: it must *join* the running job
      (``REJOIN``; the caller initialises a detached WORLD, see :mod:`ds_recycle.resilience.rejoin`).
    """
    from ds_recycle.resilience.store import connect_store

    store = connect_store(timeout_s)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    generation = int(store.add(GENERATION_KEY, 0))
    mine = f"ds_recycle/rank_generation/{rank}"
    if int(os.environ.get("DS_RECYCLE_RESTART_COUNT", "0")) > 0 and store.check([mine]):
        if generation <= int(store.get(mine)):
            return WorldStart.REJOIN
    started_for = int(os.environ.get(GENERATION_ENV, str(generation)))
    if started_for < generation:  # the job restarted every rank while this process started: its launcher restarts it
        logger.warning("started for generation %d, but the job is at generation %d: leaving as lost (exit %d)",
                       started_for, generation, LOST_EXIT_CODE)
        os._exit(LOST_EXIT_CODE)
    store.set(mine, str(generation))
    if begin_resilient_start_up(store, generation):
        logger.warning("a rank was lost during the start-up of generation %d: every rank starts again", generation)
    if generation == 0 and not is_etcd(os.environ.get("DS_RECYCLE_STORE")):
        return WorldStart.FRESH  # env://, through the launcher's TCPStore (torch's own keys, no prefix)
    if generation:
        logger.warning("generation %d: joining the restarted job from its checkpoint", generation)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"ds_recycle/gen{generation}/", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    return WorldStart.GENERATION
