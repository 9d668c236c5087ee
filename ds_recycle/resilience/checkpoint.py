"""Periodic per-stage checkpoints of the ReCycle engine, and the generation a restarted job joins.

Layout: ``<dir>/iter<N>/stage<S>.pt`` (parameters, optimizer state, learning-rate schedule, step counters
of stage ``S`` when iteration ``N`` is next) and ``<dir>/latest`` (the text ``iter<N>``, written last, by
one rank, once every stage's file is complete). ``N`` is the data position: data is a pure function of
(iteration, pipeline, micro-batch), so resuming at ``N`` neither skips nor repeats a sample.

When every worker of a stage is lost, the survivors cannot re-route: they record a fallback, bump the job's
*generation* in the launcher's store and leave as lost workers (exit code 75); with
``--restart_failed_after`` the launcher starts every rank again. A restarted process builds its WORLD under
the store prefix of the current generation (the old world's keys are still in the store) and resumes from
the latest checkpoint.
"""
from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["GENERATION_KEY", "LOST_EXIT_CODE", "init_generation_world", "load_stage", "save_stage", "write_latest"]

logger = logging.getLogger(__name__)

GENERATION_KEY = "ds_recycle/generation"
"""Store counter: how many times the whole job fell back to a checkpoint."""
LOST_EXIT_CODE = int(os.environ.get("DS_RECYCLE_LOST_EXIT_CODE", "75"))
FALLBACK_WAIT_S = 30.0
"""How long a restarted worker waits for the job to fall back before it leaves as lost (no rejoin yet)."""


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


def init_generation_world(timeout_s: float) -> bool:
    """Initialise WORLD under the current generation's store prefix when the job fell back before.

    Returns False (and does nothing) in generation 0, where the usual env:// start-up applies.
    """
    from ds_recycle.resilience.store import connect_store

    store = connect_store(timeout_s)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    generation = int(store.add(GENERATION_KEY, 0))
    mine = f"ds_recycle/rank_generation/{rank}"
    if int(os.environ.get("DS_RECYCLE_RESTART_COUNT", "0")) > 0 and store.check([mine]):
        died_in = int(store.get(mine))
        deadline = time.monotonic() + FALLBACK_WAIT_S
        while generation <= died_in and time.monotonic() < deadline:  # only a fallback lets it back in
            time.sleep(0.05)
            generation = int(store.add(GENERATION_KEY, 0))
        if generation <= died_in:
            logger.error("restarted, but the job did not fall back to a checkpoint within %.0f s; joining a "
                         "running job is not supported yet: leaving as lost", FALLBACK_WAIT_S)
            logging.shutdown()
            os._exit(LOST_EXIT_CODE)
    store.set(mine, str(generation))
    if generation == 0:
        return False
    logger.warning("generation %d: joining the restarted job from its checkpoint", generation)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"ds_recycle/gen{generation}/", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    return True
