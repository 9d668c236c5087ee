"""Heartbeats: each worker bumps a counter in the store; a counter that stops moving means a dead worker.

Counters rather than timestamps, so clocks of different hosts never need to agree: an observer
only compares successive readings on its own clock. The launcher's exit keys catch a crashed
process within milliseconds; heartbeats catch what they cannot: a hung process, or a host whose
launcher died with it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.distributed as dist

from ds_recycle.resilience.store import StoreKeys, incarnation

if TYPE_CHECKING:
    from ds_recycle.resilience.watchdog import Watchdog

logger = logging.getLogger(__name__)

__all__ = ["Heartbeat", "Liveness"]


class Heartbeat:
    """A daemon thread that increments ``ds_recycle/hb/<rank>`` every ``period_s`` over its own store client."""

    def __init__(self, store_factory: Callable[[], dist.Store], rank: int, period_s: float = 0.2,
                 keys: StoreKeys = StoreKeys()) -> None:
        self._store = store_factory()  # its own connection: never shares a socket with the training thread
        self._key = keys.heartbeat(rank)
        self._period = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{rank}", daemon=True)

    def start(self) -> Heartbeat:
        self._store.add(self._key, 1)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self._store.add(self._key, 1)
            except Exception:  # the store is gone: the job is over, nothing left to tell
                logger.debug("heartbeat stopped: store unreachable")
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self._period + 1)


class Liveness:
    """Judges ranks alive or dead from the launcher's exit keys and from heartbeat progress."""

    def __init__(self, store: dist.Store, stale_after_s: float = 1.5, keys: StoreKeys = StoreKeys(),
                 watchdog: Watchdog | None = None) -> None:
        self.store = store
        self.watchdog = watchdog
        """This worker's watchdog: a rank it declared hung (and had fenced) is dead at once."""
        self.stale_after_s = stale_after_s
        self.keys = keys
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (last counter, when it last moved)
        self.incarnations: dict[int, int] = {}
        """Restart count of each member when the current epoch began (see ``FailureProbe.incarnations``)."""

    def exited(self, rank: int) -> bool:
        """The launcher reported this rank's process gone."""
        return self.store.check([self.keys.exit(rank)])

    def stale(self, rank: int) -> bool:
        """No heartbeat progress for ``stale_after_s`` (counting from the first observation)."""
        now = time.monotonic()
        count = self.store.add(self.keys.heartbeat(rank), 0)
        last = self._seen.get(rank)
        if last is None or count != last[0]:
            self._seen[rank] = (count, now)
            return False
        return now - last[1] > self.stale_after_s

    def restarted(self, rank: int) -> bool:
        """The launcher started this rank again since the epoch began: the process we knew is gone."""
        return rank in self.incarnations and incarnation(self.store, self.keys, rank) != self.incarnations[rank]

    def dead(self, rank: int) -> bool:
        hung = self.watchdog is not None and rank in self.watchdog.hung
        return hung or self.exited(rank) or self.restarted(rank) or self.stale(rank)
