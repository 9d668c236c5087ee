"""Agreement over a real TCPStore: survivors agree on one membership; dead, hung and late ranks are handled."""
from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch.distributed as dist

from ds_recycle.resilience import Heartbeat, MembershipError, StoreKeys, agree_members
from ds_recycle.resilience.watchdog import Watchdog

KEYS = StoreKeys()


@pytest.fixture()
def server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)


def client(server: dist.TCPStore) -> Callable[[], dist.TCPStore]:
    return lambda: dist.TCPStore("127.0.0.1", server.port, None, False, timeout=timedelta(seconds=10))


def run_ranks(server: dist.TCPStore, ranks: list[int], previous: list[int], epoch: int = 1,
              stale_after_s: float = 0.5) -> dict[int, object]:
    results: dict[int, object] = {}

    def body(rank: int) -> None:
        store = client(server)()
        try:
            judge = Watchdog(client(server), rank, stale_after_s, caller_store=store)  # its training-thread calls only
            results[rank] = agree_members(store, epoch, rank, previous, judge.dead, timeout_s=5)
        except MembershipError as e:
            results[rank] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads), "agreement hung"
    return results


@pytest.mark.timeout(30)
def test_survivors_agree_without_the_exited_rank(server: dist.TCPStore) -> None:
    server.set(KEYS.exit(2), "-9")  # what the launcher writes when rank 2 dies
    results = run_ranks(server, [0, 1, 3], [0, 1, 2, 3])
    assert results == {0: [0, 1, 3], 1: [0, 1, 3], 3: [0, 1, 3]}


@pytest.mark.timeout(30)
def test_hung_rank_is_declared_dead_by_heartbeat_and_then_fenced(server: dist.TCPStore) -> None:
    hb = Heartbeat(client(server), rank=1, period_s=0.05).start()
    hb.stop()  # rank 1 hangs: its heartbeat stops moving, its process does not exit
    results = run_ranks(server, [0, 2], [0, 1, 2], stale_after_s=0.3)
    assert results == {0: [0, 2], 2: [0, 2]}
    late = run_ranks(server, [1], [0, 1, 2])[1]
    assert isinstance(late, MembershipError) and "declared dead" in str(late)


@pytest.mark.timeout(30)
def test_live_heartbeat_keeps_a_slow_rank_in(server: dist.TCPStore) -> None:
    hb = Heartbeat(client(server), rank=1, period_s=0.05).start()
    try:
        box: dict[int, object] = {}
        slow = threading.Timer(1.0, lambda: box.update(run_ranks(server, [1], [0, 1])))
        slow.start()  # rank 1 is alive but arrives 1 s late, after the 0.5 s staleness window
        results = run_ranks(server, [0], [0, 1])
        slow.join()
    finally:
        hb.stop()
    assert results[0] == [0, 1] and box[1] == [0, 1]


@pytest.mark.timeout(30)
def test_agreement_times_out_instead_of_hanging(server: dist.TCPStore) -> None:
    hb = Heartbeat(client(server), rank=1, period_s=0.05).start()  # alive but never announces
    try:
        store = client(server)()
        with pytest.raises(MembershipError, match="neither announced"):
            agree_members(store, 1, 0, [0, 1], Watchdog(client(server), 0, 5.0, caller_store=store).dead, timeout_s=0.5)
    finally:
        hb.stop()


@pytest.mark.timeout(30)
def test_watchdogs_read_one_heartbeat_each_and_a_hung_declaration_reaches_every_member(server: dist.TCPStore) -> None:
    """The watchdogs form a ring (rank r reads the next member's heartbeat): one declares rank 2 hung, asks for the
    fence, and the others trip on its published declaration at once, without waiting for the fence to act."""
    import time

    from ds_recycle.resilience.watchdog import Watchdog, _watched
    from ds_recycle.runtime import job_store

    assert [_watched((0, 1, 2, 3), r) for r in range(4)] == [(1,), (2,), (3,), (0,)]
    assert _watched((0, 2), 1) == (2,) and _watched((5,), 5) == ()
    beats = [Heartbeat(client(server), rank=r, period_s=0.05).start() for r in (0, 1, 3)]  # rank 2 never beats
    dogs = {r: Watchdog(client(server), r, stale_after_s=0.5, heartbeat_poll_s=0.05).start() for r in (0, 1, 3)}
    try:
        for dog in dogs.values():
            dog.arm([0, 1, 2, 3], {r: 0 for r in range(4)})
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(d.tripped() for d in dogs.values()):
            time.sleep(0.05)
        found = {r: d.declared for r, d in dogs.items()}
    finally:
        for dog in dogs.values():
            dog.stop()
        for hb in beats:
            hb.stop()
    assert all(f is not None and f.rank == 2 and f.hung for f in found.values()), found
    assert all("declared by rank 1" in f.reason for f in found.values() if f is not None), found  # 2's watcher
    assert all(2 in d.hung for d in dogs.values())
    assert server.get(job_store.fence_key(2)).decode().startswith("0 no heartbeat")  # one fence request
    assert not server.check([KEYS.exit(2)])  # nobody waited for the fence to take effect
