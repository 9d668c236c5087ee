"""``EtcdStore`` against a real etcd cluster (three members on loopback, ``tests/etcd_cluster.py``): the same answers
as torch's ``TCPStore`` for every operation the job uses, gloo's rendezvous between processes over it, and the loss
of any one member (the leader, the one a client talks to) while clients write and wait. Skipped, saying why, where
etcd is not installed (``launch/setup_hosts.sh`` installs it; CI runs it)."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from ds_recycle.runtime.etcd_store import EtcdStore, parse_endpoints  # noqa: E402
from tests.etcd_cluster import ETCD, EtcdCluster  # noqa: E402

needs_etcd = pytest.mark.skipif(ETCD is None, reason="etcd is not installed: `sudo bash launch/setup_hosts.sh`")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    if ETCD is None:
        pytest.skip("etcd is not installed: `sudo bash launch/setup_hosts.sh`")
    made = EtcdCluster(tmp_path_factory.mktemp("etcd"), 3)
    try:
        yield made
    finally:
        made.close()


def _store(cluster: EtcdCluster, name: str, timeout_s: float = 10.0) -> EtcdStore:
    return EtcdStore(cluster.endpoints, namespace=f"{name}/", timeout=timedelta(seconds=timeout_s))


def test_endpoints_parsed_and_bad_ones_named() -> None:
    assert parse_endpoints("etcd://h1:2379, 10.0.0.2:2380") == [("h1", 2379), ("10.0.0.2", 2380)]
    with pytest.raises(ValueError, match="'h2' in .*give host:port"):
        parse_endpoints("etcd://h1:2379,h2")


def _script(store: Any, other: Any) -> list[Any]:
    """Every operation the job uses, its edge cases included; the answers of one store (``other``: a second
    client of it, which writes the key a blocked ``get`` waits for)."""
    out: list[Any] = []
    store.set("a", "1")
    out += [store.get("a"), store.add("c", 3), store.add("c", -1), store.add("c", 0)]
    out += [store.add("fresh", 0), store.check(["fresh"]), store.compare_set("fresh", "0", "1")]  # add(k, 0) creates k
    out += [store.compare_set("x", "", "v1"), store.compare_set("x", "", "v2"), store.compare_set("x", "v1", "v3"),
            store.compare_set("x", "v1", "v4"), store.compare_set("absent", "e", "d"), store.check(["absent"])]
    out += [store.check(["a", "x"]), store.check(["a", "none"]), store.delete_key("a"), store.delete_key("a"),
            store.check(["a"])]
    for item in ("i1", "i2", "i3"):
        store.queue_push("q", item)
    out += [store.queue_len("q"), store.queue_pop("q"), store.queue_pop("q"), store.queue_len("q"),
            store.queue_pop("q"), store.queue_len("q")]
    store.set("bin", b"\x00\xff")
    out += [store.get("bin")]
    late = threading.Timer(0.2, lambda: other.set("late", "L"))  # a blocked get sees a key written later
    late.start()
    out += [store.get("late")]
    store.wait(["late", "x"])
    store.set_timeout(timedelta(seconds=0.5))
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        store.get("never")
    out.append(time.monotonic() - started < 5.0)
    return out


@needs_etcd
def test_same_answers_as_tcpstore(cluster: EtcdCluster) -> None:
    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", tcp.port, is_master=False, timeout=timedelta(seconds=10))
    expected = _script(tcp, client)
    assert _script(_store(cluster, "parity"), _store(cluster, "parity")) == expected


@needs_etcd
def test_concurrent_adds_and_compare_sets_lose_nothing(cluster: EtcdCluster) -> None:
    """Four clients (threads, each its own sessions) add 50 times each and race for one compare_set."""
    store = _store(cluster, "race")
    winners: list[bytes] = []

    def work(i: int) -> None:
        mine = _store(cluster, "race")
        for _ in range(50):
            mine.add("n", 1)
        winners.append(mine.compare_set("winner", "", f"w{i}"))
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert store.add("n", 0) == 200
    assert len(set(winners)) == 1 and len(winners) == 4, winners


_GLOO = """
import sys, torch, torch.distributed as dist
from datetime import timedelta
from ds_recycle.runtime.etcd_store import EtcdStore
rank, endpoints = int(sys.argv[1]), sys.argv[2]
store = dist.PrefixStore("job/", EtcdStore(endpoints, namespace="gloo/", timeout=timedelta(seconds=60)))
dist.init_process_group("gloo", store=store, rank=rank, world_size=3, timeout=timedelta(seconds=60))
t = torch.full((4,), float(rank + 1))
dist.all_reduce(t)
sub = dist.new_group([0, 2])
if rank != 1:
    dist.all_reduce(t, group=sub)
print("RESULT", rank, t.tolist(), flush=True)
dist.destroy_process_group()
"""


@needs_etcd
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_gloo_rendezvous_and_groups_over_etcd(cluster: EtcdCluster) -> None:
    """torch.distributed's own start-up (init_process_group, new_group) over the etcd store, three processes."""
    procs = [subprocess.Popen([sys.executable, "-c", _GLOO, str(r), cluster.endpoints], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}) for r in range(3)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=90)[0])
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)
    assert "RESULT 0 [12.0, 12.0, 12.0, 12.0]" in outs[0] and "RESULT 1 [6.0, 6.0, 6.0, 6.0]" in outs[1], outs


def _keep_writing(store: EtcdStore, stop: threading.Event, done: list[int], errors: list[BaseException]) -> None:
    i = 0
    try:
        while not stop.is_set():
            store.set(f"k{i}", str(i))
            assert store.get(f"k{i}") == str(i).encode()
            assert store.compare_set(f"c{i}", "", "x") == b"x"
            i += 1
            done.append(i)
    except BaseException as e:  # noqa: BLE001 (reported by the test)
        errors.append(e)


@needs_etcd
@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", ["leader", "client's member"])
def test_losing_any_one_member_costs_a_retry(tmp_path: Path, victim: str) -> None:
    """SIGKILL one member of three while a client writes in a loop and another waits in a get: both go on (the
    writer within a second or two), the waiting get returns once a third client sets its key; the member restarts
    and rejoins. Then two of three lost: no quorum, and operations fail within the store's timeout, saying so."""
    if ETCD is None:
        pytest.skip("etcd is not installed")
    cluster = EtcdCluster(tmp_path, 3)
    try:
        leader = cluster.leader()
        target = leader if victim == "leader" else (leader + 1) % 3
        writer = _store(cluster, "loss")
        writer.endpoints = writer.endpoints[target:] + writer.endpoints[:target]  # it talks to the victim first
        writer.set("warm", "1")
        stop, done, errors = threading.Event(), [0], []
        waiter_result: list[bytes] = []
        waiter = threading.Thread(target=lambda: waiter_result.append(_store(cluster, "loss").get("wake")))
        loop = threading.Thread(target=_keep_writing, args=(writer, stop, done, errors))
        waiter.start()
        loop.start()
        time.sleep(0.5)
        before = done[-1]
        cluster.kill(target)
        killed_at = time.monotonic()
        deadline = killed_at + 15
        while done[-1] < before + 20 and time.monotonic() < deadline and not errors:
            time.sleep(0.01)
        gap = time.monotonic() - killed_at
        assert not errors, errors
        assert done[-1] >= before + 20, f"the writer stalled after the kill of the {victim}\n{cluster.logs()}"
        _store(cluster, "loss").set("wake", "up")
        waiter.join(15)
        assert waiter_result == [b"up"]
        stop.set()
        loop.join(15)
        print(f"{victim} killed: 20 more write rounds within {gap:.2f} s")
        cluster.start(target)
        cluster.wait_healthy([target], 30)
        rejoined = EtcdStore([("127.0.0.1", cluster.client_ports[target])], namespace="loss/",
                             timeout=timedelta(seconds=10))
        assert rejoined.get("wake") == b"up", "the restarted member caught up"
        cluster.kill(target)
        cluster.kill((target + 1) % 3)
        lonely = _store(cluster, "loss", timeout_s=3.0)
        started = time.monotonic()
        with pytest.raises(dist.DistStoreError, match="no member answered|not set"):
            lonely.set("no-quorum", "x")
        assert time.monotonic() - started < 30
    finally:
        cluster.close()


@needs_etcd
def test_num_keys_counts_the_namespace_only(cluster: EtcdCluster) -> None:
    store = _store(cluster, "count")
    other = _store(cluster, "count-other")
    for k in ("a", "b"):
        store.set(k, "1")
    other.set("c", "1")
    assert store.num_keys() == 2
