"""``ds-recycle store``: the job's store as a service of its own, so that no node's loss takes the store with it.

By default node 0's launcher hosts the store, and the job ends when node 0 is lost (the other launchers see
the store gone and stop their workers; the last complete checkpoint stays the fallback). Run the store on a
host that has no workers instead, and give every launcher ``--store_service``::

    ds-recycle store --port 29500                                   # on the store's host, e.g. 10.0.0.9
    ds-recycle launch --hostfile hosts --store_service --master_addr 10.0.0.9 --master_port 29500 train.py ...

The service hosts the TCP store, waits for node 0 to write the job's layout, then runs the node watch over
every node (node 0 included; :mod:`.hostwatch`): a node silent for ``--node_timeout`` is declared lost. It
exits by itself (status 0) once every rank of the job has an exit key and no launcher has beaten for
``--linger`` seconds (every launcher is gone), or on SIGINT/SIGTERM. Its state is in memory only: if the
service itself dies the job cannot go on (every launcher sees the store gone and stops its workers).
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from types import FrameType
from typing import TYPE_CHECKING

from ds_recycle.runtime import job_store as keys

if TYPE_CHECKING:
    from torch.distributed import Store

__all__ = ["add_arguments", "run"]

logger = logging.getLogger("ds_recycle.runtime.job_store")

_POLL_S = 0.25


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: every interface)")
    parser.add_argument("--port", type=int, default=29500, help="port to listen on; 0 picks a free one (logged)")
    parser.add_argument("--linger", type=float, default=None,
                        help="seconds without any launcher's heartbeat, once every rank has exited, before the "
                             "service exits (default: the job's --node_timeout)")


def _job_over(store: Store, world_size: int) -> bool:
    return bool(store.check([keys.exit_key(r) for r in range(world_size)]))


def run(args: argparse.Namespace) -> int:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="[ds-recycle store] %(asctime)s %(levelname)s %(message)s")
    from ds_recycle.launcher.hosts import Layout
    from ds_recycle.launcher.hostwatch import LAYOUT_KEY, NODE_TIMEOUT_KEY, NodeWatch, node_hb_key

    try:
        store = keys.host_store(args.host, args.port, 30.0)
    except OSError as err:
        print(f"ds-recycle store: error: {err}", file=sys.stderr)
        return 2
    logger.info("store at %s:%d; waiting for node 0 to write the job's layout", args.host, store.port)
    stopped: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stopped.append(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    watch: NodeWatch | None = None
    beats: list[int] = []
    quiet_since = time.monotonic()
    while not stopped:
        time.sleep(_POLL_S)
        if watch is None:
            if store.check([LAYOUT_KEY, NODE_TIMEOUT_KEY]):
                layout = Layout.decode(store.get(LAYOUT_KEY).decode())
                timeout = float(store.get(NODE_TIMEOUT_KEY).decode())
                watch = NodeWatch(layout, timeout, range(len(layout.nodes)))
                linger = args.linger if args.linger is not None else timeout
                logger.info("job of %d node(s), %d rank(s); node timeout %.1f s", len(layout.nodes),
                            layout.world_size, timeout)
            continue
        watch.poll(store)
        now_beats = [store.add(node_hb_key(k), 0) for k in watch.watched]
        if now_beats != beats:
            beats, quiet_since = now_beats, time.monotonic()
        if _job_over(store, watch.layout.world_size) and time.monotonic() - quiet_since >= linger:
            logger.info("every rank has exited and no launcher has beaten for %.1f s: done", linger)
            return 0
    logger.info("stopped by signal %d", stopped[0])
    return 0
