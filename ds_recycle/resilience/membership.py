"""Agreement on who is alive, over the store, after a failure.

Round ``e`` (epochs count failures handled so far):

1. every survivor announces itself: ``epoch/<e>/alive/<rank>``;
2. it waits until each rank of the previous membership has either announced itself or is dead (the
   worker's failure detector judges: its launcher reported its exit, or its heartbeat stopped, see
   :meth:`ds_recycle.resilience.watchdog.Watchdog.dead`);
3. it proposes the announced ranks as the new membership with ``compare_set`` on ``epoch/<e>/members``:
   the first proposal written wins, and every survivor adopts the stored value, so all agree.

A rank that announces itself too late (it was slow, not dead) finds a membership without itself and
must leave: :class:`MembershipError` tells it so. Every wait is bounded by ``timeout_s``.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch.distributed as dist

from ds_recycle.resilience.errors import MembershipError
from ds_recycle.resilience.store import StoreKeys

logger = logging.getLogger(__name__)

__all__ = ["MembershipError", "agree_members"]


def agree_members(store: dist.Store, epoch: int, rank: int, previous: Sequence[int], dead: Callable[[int], bool],
                  timeout_s: float = 30.0, poll_s: float = 0.01, keys: StoreKeys = StoreKeys()) -> list[int]:
    """Return the agreed sorted list of live ranks for round ``epoch`` (this rank included)."""
    store.set(keys.alive(epoch, rank), "1")
    deadline = time.monotonic() + timeout_s
    pending = set(previous) - {rank}
    while pending:
        if store.check([keys.members(epoch)]):
            break  # someone already decided; adopt it below
        pending = {q for q in pending if not store.check([keys.alive(epoch, q)]) and not dead(q)}
        if time.monotonic() > deadline:
            raise MembershipError(f"agreement round {epoch}: ranks {sorted(pending)} neither announced "
                                  f"themselves nor were found dead within {timeout_s} s")
        time.sleep(poll_s)
    proposal = ",".join(str(q) for q in previous if q == rank or store.check([keys.alive(epoch, q)]))
    agreed = store.compare_set(keys.members(epoch), "", proposal).decode()
    members = [int(q) for q in agreed.split(",") if q]
    if rank not in members:
        raise MembershipError(f"agreement round {epoch}: this rank ({rank}) was declared dead by the others "
                              f"(members {members}); it must leave and rejoin")
    logger.info("agreement round %d: members %s", epoch, members)
    return members
