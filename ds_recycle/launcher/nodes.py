"""A launcher's watch over nodes whose launchers it did not start: did they connect, are they done.

With ``--no_ssh`` every node's launcher is started by someone else (a scheduler, a person), with the same
hostfile and ``--node_rank K``. Node 0 hosts the store (unless a ``ds-recycle store`` service does) and computes
the job's status, so it waits until every rank of every node has exited: for their ``ds_recycle/exit/<rank>``
keys. Each launcher of node K > 0 writes ``ds_recycle/node/<K>`` (its host name) when it has connected; a node
that has not done so within the connect timeout (``--store_timeout``) is reported and the job is stopped, since
its ranks can never join. On an etcd store with several hosts every node's launcher watches all the others
this way and reports the job's status (node 0's own may be lost; node 0 announces itself there too).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from torch.distributed import Store

from ds_recycle.launcher.hosts import Layout
from ds_recycle.runtime import job_store as keys

__all__ = ["OtherNodes"]

logger = logging.getLogger(__name__)


class OtherNodes:
    """The ranks of ``node_ranks`` as node 0 sees them through the store."""

    def __init__(self, store: Store, layout: Layout, node_ranks: Sequence[int], connect_timeout_s: float) -> None:
        self.store = store
        self.node_ranks = tuple(node_ranks)
        self.ranks = tuple(r for k in self.node_ranks
                           for r in range(layout.offset(k), layout.offset(k) + len(layout.nodes[k].slots)))
        self._connect_deadline = time.monotonic() + connect_timeout_s
        self._connected: set[int] = set()
        self._give_up_at: float | None = None

    def missing_nodes(self) -> list[int]:
        """Nodes that have not connected by the deadline (empty before the deadline)."""
        if len(self._connected) < len(self.node_ranks):
            self._connected |= {k for k in self.node_ranks if self.store.check([keys.node_key(k)])}
        if time.monotonic() < self._connect_deadline:
            return []
        return [k for k in self.node_ranks if k not in self._connected]

    def pending(self) -> bool:
        """Some rank of these nodes has not exited yet (False once :meth:`give_up_after` has expired)."""
        if self._give_up_at is not None and time.monotonic() >= self._give_up_at:
            return False
        return not self.store.check([keys.exit_key(r) for r in self.ranks])

    def give_up_after(self, seconds: float) -> None:
        """Stop waiting for exits ``seconds`` from now (the job is being stopped; a node may be gone)."""
        if self._give_up_at is None:
            self._give_up_at = time.monotonic() + seconds
