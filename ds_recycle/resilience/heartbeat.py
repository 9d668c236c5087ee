"""Heartbeats: each worker bumps a counter in the store; a counter that stops moving means a dead worker.

Counters rather than timestamps, so clocks of different hosts never need to agree: an observer
only compares successive readings on its own clock. The launcher's exit keys catch a crashed
process within milliseconds; heartbeats catch what they cannot: a hung process, or a host whose
launcher died with it. This module only writes them; the watchdog
(:mod:`ds_recycle.resilience.watchdog`) is the one reader.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch.distributed as dist

from ds_recycle.resilience.store import StoreKeys

logger = logging.getLogger(__name__)

__all__ = ["Heartbeat"]


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
