"""The node watch, the lease's fence and the gloo interface choice, without processes or a network."""
from __future__ import annotations

import json
import threading
import time

import pytest
from torch.distributed import HashStore

from ds_recycle.events import HostLostEvent, parse_event
from ds_recycle.launcher.hosts import Layout, NodeSlots
from ds_recycle.launcher.hostwatch import HostEvents, Lease, NodeWatch, node_declare_key, node_hb_key, node_lost_key
from ds_recycle.launcher.job import JobSpec, Program
from ds_recycle.launcher.netif import gloo_interface_env
from ds_recycle.launcher.remote import launcher_argv
from ds_recycle.runtime import job_store as keys

LAYOUT = Layout((NodeSlots("h0", (0, 1)), NodeSlots("h1", (0, 1)), NodeSlots("h2", (0, 1))))


def _beat(store: HashStore, node: int) -> None:
    store.add(node_hb_key(node), 1)


def test_a_silent_node_is_declared_lost_once_and_its_unfinished_ranks_get_exit_75() -> None:
    store = HashStore()
    watch = NodeWatch(LAYOUT, node_timeout_s=10.0, watched=[1, 2])
    store.set(keys.exit_key(3), "0")  # rank 3 (node 1) finished before its host went silent
    _beat(store, 1)
    _beat(store, 2)
    assert watch.poll(store, now=0.0) == []
    _beat(store, 2)
    assert watch.poll(store, now=9.9) == []
    _beat(store, 2)
    assert watch.poll(store, now=10.1) == [1]  # node 1 silent since t=0; node 2 beat at 9.9
    assert store.get(keys.exit_key(2)) == b"75" and store.get(keys.exit_key(3)) == b"0"
    assert store.add(keys.EXITS_KEY, 0) == 1 and store.check([node_lost_key(1)])
    assert watch.poll(store, now=30.0) == [2]  # node 2 went silent after 10.1
    assert watch.poll(store, now=60.0) == []  # each declared once
    events = HostEvents(store).drain()
    assert [(type(e), e.node, e.marked_lost) for e in events] == [(HostLostEvent, 1, (2,)), (HostLostEvent, 2, (4, 5))]


def test_a_node_that_never_beat_is_not_declared_and_a_returning_node_is_watched_afresh() -> None:
    store = HashStore()
    watch = NodeWatch(LAYOUT, node_timeout_s=5.0, watched=[1])
    assert watch.poll(store, now=100.0) == []  # never connected: the connect timeout's business
    _beat(store, 1)
    watch.poll(store, now=100.0)
    assert watch.poll(store, now=106.0) == [1]
    store.delete_key(node_lost_key(1))  # its launcher came back and restarted its ranks
    _beat(store, 1)
    assert watch.poll(store, now=107.0) == []
    assert watch.poll(store, now=111.0) == []
    assert watch.poll(store, now=112.5) == [1]  # silent again for 5 s after its return


def test_host_events_are_drained_once_each() -> None:
    store = HashStore()
    feed = HostEvents(store)
    watch = NodeWatch(LAYOUT, 1.0, [2])
    _beat(store, 2)
    watch.poll(store, now=0.0)
    watch.poll(store, now=2.0)
    first = feed.drain()
    assert [e.kind for e in first] == ["host_lost"] and feed.drain() == []
    assert parse_event(json.loads(json.dumps(first[0].to_dict()))) == first[0] and first[0].host == "h2"


class _SilentStore:
    """Answers until ``silence`` is set, then blocks every call as a cut link does (until ``heal``)."""

    def __init__(self) -> None:
        self.silence = threading.Event()
        self.heal = threading.Event()
        self.beats = 0

    def add(self, key: str, value: int) -> int:
        if self.silence.is_set():
            self.heal.wait(30)
        self.beats += value
        return self.beats

    def check(self, keys: list[str]) -> bool:
        if self.silence.is_set():
            self.heal.wait(30)
        return False


def test_the_lease_fences_within_half_the_node_timeout_while_the_store_is_silent() -> None:
    store = _SilentStore()
    fenced = threading.Event()
    lease = Lease("h", 1, 1, node_timeout_s=1.0, give_up_s=60.0)
    lease.start(store, fenced.set)  # type: ignore[arg-type]
    try:
        time.sleep(0.6)
        assert not fenced.is_set() and store.beats >= 1 and lease.fenced_at is None
        store.silence.set()
        cut = time.monotonic()
        assert fenced.wait(5.0)
        assert 0.4 <= time.monotonic() - cut <= 2.0  # fence time 0.5 s, polled every 0.25 s
        assert not lease.beating and not lease.reachable_since_fence()
        beats = store.beats
        store.heal.set()
        store.silence.clear()
        deadline = time.monotonic() + 5
        while not lease.reachable_since_fence() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lease.reachable_since_fence()
        time.sleep(0.6)
        assert store.beats == beats + 1  # while fenced it only reads (the blocked beat completed, no new one)
        lease.resume()
        time.sleep(0.6)
        assert store.beats > beats + 1
    finally:
        store.heal.set()
        lease.stop()


@pytest.mark.parametrize("env, nodes, host, expect", [
    ({}, 1, "localhost", {}),                                     # one node: nothing to do
    ({"GLOO_SOCKET_IFNAME": "eth7"}, 2, "localhost", {}),         # the user chose
    ({}, 2, "localhost", {}),                                     # the store is on loopback: all on this machine
])
def test_gloo_interface_is_left_alone_unless_needed(env: dict[str, str], nodes: int, host: str,
                                                    expect: dict[str, str]) -> None:
    assert gloo_interface_env("127.0.0.1", env, nodes > 1, hostname=host) == expect


def test_remote_launchers_get_the_node_timeout_and_the_store_service_flag() -> None:
    job = JobSpec(LAYOUT, 0, "10.0.0.9", 29500, Program("t.py"), base_env={}, node_timeout_s=7.5,
                  store_service=True)
    argv = launcher_argv(job, 2)
    assert argv[argv.index("--node_timeout") + 1] == "7.5" and "--store_service" in argv
    with pytest.raises(ValueError, match="--node_timeout 0"):
        JobSpec(LAYOUT, 0, "h", 1, Program("t.py"), base_env={}, node_timeout_s=0)


def test_several_watchers_declare_each_loss_once_and_take_over_a_dead_watchers_claim() -> None:
    """A job on etcd: every launcher watches the others; one declaration (exit keys, event) per loss."""
    store = HashStore()
    watchers = [NodeWatch(LAYOUT, 5.0, [2], me=str(k)) for k in (0, 1)]
    _beat(store, 2)
    for watch in watchers:
        watch.poll(store, now=0.0)
    declared = [watch.poll(store, now=6.0) for watch in watchers]
    assert declared == [[2], []] and all(2 in watch.lost for watch in watchers)
    assert store.add(keys.EXITS_KEY, 0) == 1 and len(HostEvents(store).drain()) == 1
    # node 2 comes back (its launcher deletes node_lost and its claim), beats, then goes silent again; the watcher
    # that claims it dies before writing node_lost: the other takes the claim over after a node timeout
    store.delete_key(node_lost_key(2))
    store.delete_key(node_declare_key(2))
    for r in (4, 5):
        store.delete_key(keys.exit_key(r))
    _beat(store, 2)
    for watch in watchers:
        watch.poll(store, now=7.0)
    store.set(node_declare_key(2), f"{store.add(node_hb_key(2), 0)} 0 {time.time() - 6.0:.3f}")  # dead claimer
    assert watchers[1].poll(store, now=13.0) == [2]
    assert store.get(keys.exit_key(4)) == b"75" and store.check([node_lost_key(2)])
