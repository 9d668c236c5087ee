"""A worker for test_comm.py: all-reduces in a loop on an epoch group; on PeerFailure, agrees and goes on.

A failure can interrupt an all-reduce that some members completed and others did not, so after each
agreement the members also agree on how many all-reduces count as done (the smallest count), as the
engine does with its iteration snapshots; and nobody leaves before every member has finished.
"""
from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch

from ds_recycle.resilience import Heartbeat, PeerFailure, StoreKeys, agree_members, connect_store
from ds_recycle.resilience.comm import EpochGroup, bounded_wait
from ds_recycle.resilience.watchdog import Watchdog, watch_members

rank, world, iters = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
store = connect_store(10)
Heartbeat(lambda: connect_store(10), rank, period_s=0.1).start()
watchdog = Watchdog(lambda: connect_store(10), rank, 1.0, caller_store=store).start()
members = list(range(world))
watch_members(watchdog, store, StoreKeys(), members)
group = EpochGroup(store, "e0", members, rank, timeout_s=30)
watchdog.guard([group])
epoch, done = 0, 0
retired: list[EpochGroup] = []
while done < iters:
    t = torch.ones(1)
    try:
        bounded_wait(group.all_reduce_sum(t), watchdog, "all-reduce")
    except PeerFailure as e:
        t0 = time.monotonic()
        epoch += 1
        members = agree_members(store, epoch, rank, members, watchdog.dead, timeout_s=20)
        retired.append(group)  # never destroyed under the feet of members still inside it
        watch_members(watchdog, store, StoreKeys(), members)
        group = EpochGroup(store, f"e{epoch}", members, rank, timeout_s=30)
        watchdog.guard([group])
        store.set(f"test/e{epoch}/done/{rank}", str(done))
        keys = [f"test/e{epoch}/done/{r}" for r in members]
        store.wait(keys, timedelta(seconds=20))
        done = min(int(store.get(k)) for k in keys)
        print(f"rank {rank} recovered members={members} in {time.monotonic() - t0:.3f}s after: {e}", flush=True)
        continue
    assert t.item() == len(members), (t.item(), members)
    done += 1
    if done == 1:
        store.set(f"test/ready/{rank}", "1")
    time.sleep(0.002)
store.set(f"test/finished/{rank}", "1")
store.wait([f"test/finished/{r}" for r in members], timedelta(seconds=20))
print(f"rank {rank} done members={members}", flush=True)
os._exit(0)  # tearing down groups that still reference the dead peer can abort inside gloo
