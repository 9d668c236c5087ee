"""What a fallback to the checkpoint hands to the restarted job: its events, and the request to restart.

When a whole stage is lost the survivors leave (see :mod:`ds_recycle.resilience.checkpoint`). Two things must
survive them:

* the events of the iteration that was in flight (``failure``, ``agreement``, ``fallback``): the lowest
  surviving member writes them into the store under the next generation (``ds_recycle/gen<g>/carried_events``, JSON), and the
  restarted reporter records them first, with its ``resumed`` event, so the metrics file keeps one continuous
  record;
* the restart of every rank: ``ds_recycle/restart_all`` = ``g`` asks every launcher to start each of its ranks
  again once it is lost (:mod:`ds_recycle.launcher.supervisor`), so checkpoint flags alone are enough;
* the checkpoint directory (``ds_recycle/gen<g>/fallback_directory``): a user's script that never loads a
  checkpoint itself is resumed from it by ``ds_recycle.initialize``.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from ds_recycle.runtime import job_store as launcher_store

__all__ = ["carried_events", "carry_events", "fallback_directory", "hand_over_directory", "request_restart_all"]

logger = logging.getLogger(__name__)


def carry_events(store: dist.Store, generation: int, writer: bool, events: Sequence[dict[str, Any]]) -> None:
    """Hand ``events`` to generation ``generation`` (one survivor, ``writer``, does: they all hold the same)."""
    if writer:
        store.set(launcher_store.carried_events_key(generation), json.dumps(list(events)))


def carried_events(store: dist.Store, generation: int) -> list[dict[str, Any]]:
    """The events the previous generation handed over (empty for generation 0 or when none were)."""
    if generation == 0 or not store.check([launcher_store.carried_events_key(generation)]):
        return []
    return list(json.loads(store.get(launcher_store.carried_events_key(generation))))


def hand_over_directory(store: dist.Store, generation: int, directory: str) -> None:
    """Tell generation ``generation`` which checkpoint directory it resumes from."""
    store.set(launcher_store.fallback_directory_key(generation), directory)


def fallback_directory(store: dist.Store, generation: int) -> str | None:
    """The checkpoint directory the previous generation fell back to (None: generation 0, or none named)."""
    if generation == 0 or not store.check([launcher_store.fallback_directory_key(generation)]):
        return None
    return bytes(store.get(launcher_store.fallback_directory_key(generation))).decode()


def request_restart_all(store: dist.Store, generation: int) -> None:
    """Ask every launcher to start its ranks again for ``generation`` (idempotent)."""
    store.set(launcher_store.RESTART_ALL_KEY, str(generation))
