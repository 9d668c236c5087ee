"""Fencing: the launcher SIGKILLs a worker that the members declared hung, so it ends like any other death.

A member's watchdog (:mod:`ds_recycle.resilience.watchdog`) that sees a rank's heartbeat stop writes
``ds_recycle/fence/<rank>`` = ``"<restart count> <reason>"`` and increments ``ds_recycle/fence_requests``. Each
launcher polls the counter with its other store keys (every 0.25 s) and, for a request naming one of its ranks
whose *current* process has that restart count, sends SIGKILL to the process's group (SIGKILL ends a stopped
process too). The death is then reaped and reported as usual (exit key, exit counter, restart policy). A
request for an earlier process of the rank (already gone, or restarted since) is dropped.
"""
from __future__ import annotations

import logging
import signal
from collections.abc import Mapping
from dataclasses import dataclass

from torch.distributed import Store

from ds_recycle.launcher.worker import Worker
from ds_recycle.runtime import job_store as keys

__all__ = ["FenceRequest", "parse_fence_request", "poll_fence_requests"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FenceRequest:
    """One parsed ``ds_recycle/fence/<rank>`` value."""

    rank: int
    restart_count: int
    """The restart count of the process to fence (an earlier process of the rank is not the current one)."""
    reason: str


def parse_fence_request(rank: int, text: str) -> FenceRequest:
    """``"<restart count> <reason>"`` as written by a watchdog."""
    count, _, reason = text.partition(" ")
    if not count.isdigit():
        raise ValueError(f"fence request for rank {rank} does not start with a restart count: {text[:80]!r}")
    return FenceRequest(rank, int(count), reason or "no reason given")


def poll_fence_requests(store: Store, workers: Mapping[int, Worker], seen: int) -> int:
    """Carry out the fence requests for ``workers`` when the request counter moved past ``seen``; its new value."""
    count = int(store.add(keys.FENCE_REQUESTS_KEY, 0))
    if count == seen:
        return seen
    for rank, worker in sorted(workers.items()):
        key = keys.fence_key(rank)
        if not store.check([key]):
            continue
        try:
            request = parse_fence_request(rank, store.get(key).decode())
        except ValueError as err:
            logger.error("%s; ignored", err)
            store.delete_key(key)
            continue
        if worker.running and worker.restart_count == request.restart_count:
            logger.warning("fencing rank %d (pid %s): %s; SIGKILL", rank, worker.pid, request.reason,
                           extra={"event": "fence", "rank": rank, "pid": worker.pid,
                                  "restart_count": worker.restart_count})
            worker.send_signal(signal.SIGKILL)
        store.delete_key(key)
    return count
