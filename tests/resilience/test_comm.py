"""Epoch groups and bounded waits: a SIGKILLed peer becomes a PeerFailure, survivors regroup and go on."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from ds_recycle.resilience import StoreKeys
from ds_recycle.runtime.job_store import publish_exit_count

WORKER = Path(__file__).with_name("_comm_worker.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_survivors_detect_regroup_and_continue() -> None:
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    env = {**os.environ, "DS_RECYCLE_STORE": f"127.0.0.1:{store.port}", "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), "4", "400"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True) for r in range(4)]
    try:
        store.wait([f"test/ready/{r}" for r in range(4)], timedelta(seconds=60))  # all in the loop
        time.sleep(0.2)
        procs[2].send_signal(signal.SIGKILL)
        procs[2].wait(timeout=10)
        store.set(StoreKeys().exit(2), str(procs[2].returncode))  # what ds-recycle launch does when it reaps
        publish_exit_count(store, 4)  # a worker: the counter, and a wake-up in every rank's exit queue
        outs = {r: procs[r].communicate(timeout=90)[0] for r in (0, 1, 3)}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, out in outs.items():
        assert procs[r].returncode == 0, out
        assert "recovered members=[0, 1, 3]" in out, out
        assert f"rank {r} done members=[0, 1, 3]" in out, out
        recovery = float(out.split(" in ")[1].split("s after")[0])
        assert recovery < 10.0, out  # bounded: agreement, not a gloo timeout of 30 s


_PEER = """
import sys, time, torch.distributed as dist
from datetime import timedelta
from ds_recycle.resilience.comm import EpochGroup
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), None, False, timeout=timedelta(seconds=30))
group = EpochGroup(store, sys.argv[2], [int(r) for r in sys.argv[3].split(",")], int(sys.argv[4]), 30.0)
print("READY", flush=True)
time.sleep(60)
"""


def _peer(port: int, name: str = "post", members: str = "0,1", rank: int = 1) -> subprocess.Popen[str]:
    """A member ``rank`` of the group ``name`` over ``members`` that connects and then sleeps (a silent peer)."""
    return subprocess.Popen([sys.executable, "-c", _PEER, str(port), name, members, str(rank)], env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_posting_to_a_dead_peer_is_a_peer_failure() -> None:
    """Gloo may refuse to even post a send to a dead peer (a RuntimeError at once): that is a PeerFailure too."""
    import torch

    from ds_recycle.resilience.comm import EpochGroup, PeerFailure

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    peer = _peer(store.port)
    try:
        group = EpochGroup(store, "post", [0, 1], 0, 30.0)
        assert peer.stdout is not None and "READY" in peer.stdout.readline()
        peer.send_signal(signal.SIGKILL)
        peer.wait(timeout=10)
        deadline = time.monotonic() + 20
        with pytest.raises(PeerFailure, match="group post: send to rank 1"):
            while time.monotonic() < deadline:
                group.send(torch.ones(4), 1, 7)
                time.sleep(0.05)
    finally:
        if peer.poll() is None:
            peer.kill()


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_breaking_a_group_fails_a_blocked_receive_at_once_even_with_a_dead_member() -> None:
    """What the watchdog does at a trip: a receive blocked on a live but silent member raises within moments (not at
    the group's 30 s timeout), though the pair of another member is already closed; later operations fail too."""
    import threading

    import torch

    from ds_recycle.resilience.comm import EpochGroup, PeerFailure, bounded_wait
    from tests.harness import QuietDetector as Quiet  # the break below is the only thing that ends the wait

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    peers = {r: _peer(store.port, "brk", "0,1,2", r) for r in (1, 2)}
    try:
        group = EpochGroup(store, "brk", [0, 1, 2], 0, 30.0)
        for p in peers.values():
            assert p.stdout is not None and "READY" in p.stdout.readline()
        peers[1].send_signal(signal.SIGKILL)  # its pair is closed: a receive cannot be posted there
        peers[1].wait(timeout=10)
        silent = group.recv(torch.zeros(4), 2, 5)  # rank 2 lives and never sends
        timer = threading.Timer(0.5, group.break_links)
        timer.start()
        start = time.monotonic()
        with pytest.raises(PeerFailure, match="blocked receive"):
            bounded_wait(silent, Quiet(), "blocked receive")
        assert time.monotonic() - start < 5.0
        with pytest.raises(PeerFailure):
            bounded_wait(group.send(torch.ones(4), 2, 6), Quiet(), "later send")
    finally:
        for p in peers.values():
            if p.poll() is None:
                p.kill()
