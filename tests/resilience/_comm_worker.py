"""A worker for test_comm.py: all-reduces in a loop on an epoch group; on PeerFailure, agrees and goes on."""
from __future__ import annotations

import sys
import time

import torch

from ds_recycle.resilience import Heartbeat, Liveness, agree_members, connect_store
from ds_recycle.resilience.comm import EpochGroup, FailureProbe, PeerFailure, bounded_wait

rank, world, iters = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
store = connect_store(10)
Heartbeat(lambda: connect_store(10), rank, period_s=0.1).start()
members = list(range(world))
group = EpochGroup(store, "e0", members, rank, timeout_s=30)
probe = FailureProbe(store).arm(members)
epoch, done = 0, 0
retired: list[EpochGroup] = []
while done < iters:
    t = torch.ones(1)
    try:
        bounded_wait(group.all_reduce_sum(t), probe, 30, "all-reduce")
    except PeerFailure as e:
        t0 = time.monotonic()
        epoch += 1
        members = agree_members(store, epoch, rank, members, Liveness(store, 1.0), timeout_s=20)
        retired.append(group)  # never destroyed under the feet of members still inside it
        group = EpochGroup(store, f"e{epoch}", members, rank, timeout_s=30)
        probe.arm(members)
        print(f"rank {rank} recovered members={members} in {time.monotonic() - t0:.3f}s after: {e}", flush=True)
        continue
    assert t.item() == len(members), (t.item(), members)
    done += 1
    if done == 1:
        store.set(f"test/ready/{rank}", "1")
    time.sleep(0.002)
print(f"rank {rank} done members={members}", flush=True)
