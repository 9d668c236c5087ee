"""The NCCL groups of an epoch (resilience/nccl.py) against recording stand-ins for torch's NCCL backend (this CPU
build of torch has none): a step's transfers posted as one NCCL group, waits that poll and never block, the epoch's
communicators aborted inside one NCCL group with a deadline, nothing destroyed, the shrink after a removal, and where
the transport is chosen or refused."""
from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ds_recycle.config.errors import ConfigError
from ds_recycle.resilience.errors import PeerFailure
from ds_recycle.resilience.nccl import (
    NcclEpochComm,
    NcclGroup,
    ShrunkGroups,
    abort_together,
    epoch_device,
    nccl_device,
    polled_wait,
)
from ds_recycle.resilience.phases import Agreement, Job, shrink_failed
from ds_recycle.resilience.store import StoreKeys
from tests.harness import assert_same_model, failure_report, run, tiny_config

GPU = torch.device("cuda", 0)


class Calls:
    """What every stand-in was asked, in order, across all of them."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []


class FakeWork:
    def __init__(self, done_after: int = 0, error: BaseException | None = None) -> None:
        self.polls, self.done_after, self.error, self.waited = 0, done_after, error, False

    def is_completed(self) -> bool:
        self.polls += 1
        return self.polls > self.done_after

    def wait(self) -> bool:
        self.waited = True
        if self.error is not None:
            raise self.error
        return True


class FakePG:
    """The unregistered ProcessGroup's calls the group makes."""

    def __init__(self, calls: Calls, name: str) -> None:
        self.calls, self.name = calls, name

    def __getattr__(self, op: str) -> Any:
        def call(*args: Any) -> FakeWork:
            shown = [a.rootRank if isinstance(a, dist.BroadcastOptions) else a for a in args
                     if not isinstance(a, (dist.AllreduceOptions, dist.AllToAllOptions))]
            self.calls.log.append((self.name, op, *shown))
            return FakeWork()
        return call


class FakeBackend:
    supports_shrinking = False

    def __init__(self, calls: Calls, name: str, hang: threading.Event | None = None) -> None:
        self.calls, self.name, self.hang = calls, name, hang

    def _group_start(self) -> None:
        self.calls.log.append(("group_start", self.name))

    def _group_end(self) -> None:
        self.calls.log.append(("group_end", self.name))

    def abort(self) -> None:
        self.calls.log.append(("abort", self.name))
        if self.hang is not None:
            self.hang.wait(5.0)

    def __getattr__(self, op: str) -> Any:  # destroy, shutdown, split, ...: never called after a failure
        raise AssertionError(f"the backend's {op} was called")


class Shrinkable(FakeBackend):
    supports_shrinking = True


def fake_connect(calls: Calls, backend: type[FakeBackend] = FakeBackend) -> Any:
    def connect(store: dist.Store, index: int, size: int, timeout_s: float, device: torch.device) -> tuple[Any, Any]:
        name = f"comm{len([c for c in calls.log if c[0] == 'connect'])}"
        calls.log.append(("connect", name, index, size, timeout_s, str(device)))
        return backend(calls, name), FakePG(calls, name)
    return connect


def fake_shrink(calls: Calls, fails: str = "") -> Any:
    """``nccl.shrink_nccl``'s stand-in: the child is ``<parent>-shrunk``; the shrink of ``fails`` raises."""
    def shrink(backend: FakeBackend, store: dist.Store, excluded: list[int]) -> tuple[Any, Any]:
        calls.log.append(("shrink", backend.name, list(excluded)))
        if backend.name == fails:
            raise RuntimeError("NCCL error: remote process exited")
        return Shrinkable(calls, f"{backend.name}-shrunk"), FakePG(calls, f"{backend.name}-shrunk")
    return shrink


class Detector:
    def __init__(self) -> None:
        self.dead = False

    def failed(self) -> bool:
        return self.dead

    def tripped(self) -> bool:
        return self.dead

    def reason(self) -> str:
        return "rank 3 exited"


def test_a_steps_transfers_go_as_one_nccl_group_addressed_by_the_groups_own_numbering() -> None:
    calls = Calls()
    group = NcclGroup(dist.HashStore(), "e1/p2p", [7, 2, 5], 5, 60.0, GPU, fake_connect(calls))
    assert calls.log == [("connect", "comm0", 1, 3, 60.0, "cuda:0")]
    a, b = torch.zeros(2), torch.zeros(3)
    works = group.post_p2p([(True, a, 7), (False, b, 2)])
    assert [c[1] for c in calls.log[1:]] == ["_start_coalescing", "send", "recv", "_end_coalescing"]
    assert calls.log[2][2:] == ([a], 2, 0) and calls.log[3][2:] == ([b], 0, 0)  # ranks 7 and 2 are indices 2, 0
    assert len(works) == 2 and works[0] is works[1]  # the group's work completes them all
    assert group.post_p2p([]) == [] and len(calls.log) == 5
    group.broadcast(a, 7)
    group.all_reduce_sum(a)
    assert calls.log[-2][1:] == ("broadcast", [a], 2) and calls.log[-1][1:] == ("allreduce", [a])
    with pytest.raises(ValueError, match="rank 4 is not a member"):
        NcclGroup(dist.HashStore(), "x", [1, 2], 4, 1.0, GPU, fake_connect(calls))


def test_a_wait_polls_and_never_blocks_and_a_dead_member_or_the_timeout_ends_it() -> None:
    detector = Detector()
    work = FakeWork(done_after=3)
    polled_wait(work, detector, "receive", timeout_s=5.0)
    assert work.polls == 4 and work.waited
    spinning = FakeWork(done_after=10**9)  # a peer that died inside the node: NCCL spins, reports nothing
    threading.Timer(0.05, lambda: setattr(detector, "dead", True)).start()
    began = time.monotonic()
    with pytest.raises(PeerFailure, match="receive: rank 3 exited"):
        polled_wait(spinning, detector, "receive", timeout_s=30.0)
    assert time.monotonic() - began < 2.0 and not spinning.waited
    with pytest.raises(PeerFailure, match="before waiting"):
        polled_wait(FakeWork(), detector, "send", timeout_s=5.0)
    with pytest.raises(PeerFailure, match="not complete after 0 s"):
        polled_wait(FakeWork(done_after=10**9), Detector(), "all-reduce", timeout_s=0.05)
    with pytest.raises(PeerFailure, match="NCCL error"):
        polled_wait(FakeWork(error=RuntimeError("NCCL error: remote process exited")), Detector(), "send", 5.0)
    sticky = RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError, match="illegal memory access") as raised:
        polled_wait(FakeWork(error=sticky), Detector(), "send", 5.0)
    assert not isinstance(raised.value, PeerFailure)


def test_the_epochs_communicators_are_aborted_inside_one_nccl_group_once_and_never_destroyed() -> None:
    calls = Calls()
    comm = NcclEpochComm.build_nccl(dist.HashStore(), 4, [0, 2, 3], [0, 3], 3, 30.0, Detector(), GPU, "g0",
                                    {"embed": [0, 3]}, connect=fake_connect(calls))
    assert [(c[2], c[3]) for c in calls.log] == [(2, 3), (2, 3), (1, 2), (1, 2)]  # p2p, norm, stage, tied
    assert comm.device == GPU and comm.members == [0, 2, 3] and comm.stage.members == [0, 3]
    assert comm.stage.name == "e4g0/stage-0-3" and comm.tied["embed"].name == "e4g0/embed"
    calls.log.clear()
    comm.retire()
    comm.retire()
    assert calls.log == [("group_start", "comm0"), ("abort", "comm0"), ("abort", "comm1"), ("abort", "comm2"),
                         ("abort", "comm3"), ("group_end", "comm0")]
    assert comm.retired_in_s is not None and comm.retired_in_s < 5.0
    comm.p2p.break_links()  # the watchdog's thread does nothing to NCCL
    assert len(calls.log) == 6


def test_an_abort_that_hangs_makes_the_worker_leave_within_the_deadline_and_an_abort_error_is_only_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    calls, hang = Calls(), threading.Event()
    left: list[str] = []
    began = time.monotonic()
    abort_together([FakeBackend(calls, "a"), FakeBackend(calls, "b", hang)], deadline_s=0.2, on_hang=left.append)
    assert time.monotonic() - began < 2.0 and left and "did not return within 0 s" in left[0]
    hang.set()

    class Failing(FakeBackend):
        def abort(self) -> None:
            raise RuntimeError("NCCL error: invalid usage")
    abort_together([Failing(calls, "c")], deadline_s=5.0, on_hang=left.append)
    assert len(left) == 1 and "invalid usage" in caplog.text


def test_the_nccl_transport_is_refused_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="recycle.transport.*worker whose device is cpu.*Fix: use \"auto\""):
        nccl_device(torch.device("cpu"), 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    with pytest.raises(ConfigError, match="4 workers on each GPU"):
        nccl_device(GPU, 4)
    assert nccl_device(GPU, 1) == GPU
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    with pytest.raises(ConfigError, match="without NCCL"):
        nccl_device(GPU, 1)


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize("kills, dead, shrink", [(["1:0@3:forward"], {1}, False), (["0:1@2:receive"], {2}, True),
                                                 (["1:0@2:forward", "0:1@4:forward"], {1, 2}, True)])
def test_a_job_on_the_nccl_path_over_stand_in_communicators_survives_a_kill_at_the_failure_free_model(
        tmp_path: Path, reference: Callable[[int, int, int], Path], kills: list[str], dead: set[int],
        shrink: bool) -> None:
    """The NCCL transport's whole path in a real 2 x 2 job (tests/resilience/_nccl_emulated_train.py: gloo stands in
    for NCCL's communicators): every epoch's groups built as NCCL's, each step's transfers posted as one group, the
    failed epoch retired by one group abort on every survivor before they regroup, and the model at the end the
    failure-free one, bit for bit. With ``shrink``, the survivors' p2p and norm communicators are the failed
    epoch's, shrunk after the agreement, and only the stage groups are built afresh; after a second kill the shrunk
    communicators are shrunk again."""
    config = tiny_config(tmp_path, "nccl", 2, 2, failure_timeout_s=60.0, transport="nccl")
    out, calls = tmp_path / "final.pt", tmp_path / "calls"
    calls.mkdir()
    job = run([sys.executable, "-m", "ds_recycle", "launch", "--num_accelerators", "4", "--master_port", "0",
               str(Path(__file__).parent / "_nccl_emulated_train.py"), "--deepspeed_config", str(config),
               "--steps", "7", "--save-final", str(out), *[a for k in kills for a in ("--kill", k)]], timeout=180,
              env={"NCCL_CALLS_DIR": str(calls), "NCCL_STANDIN_SHRINK": "1" if shrink else "0"})
    assert job.returncode == 0, failure_report(job.output)
    assert_same_model(out, reference(2, 2, 7))
    seen = {p.stem: json.loads(p.read_text()) for p in calls.glob("*.json")}
    survivors = [seen[f"rank{r}-life0"] for r in range(4) if r not in dead]
    epochs = 1 + len(kills)
    for rank_calls in survivors:
        built = rank_calls["communicators"] + rank_calls["shrinks"]
        assert built == 3 * epochs  # p2p, norm, stage: the first epoch's and the survivors'
        assert rank_calls["shrinks"] == (2 * len(kills) if shrink else 0)  # a stage group left with one member: built
        assert rank_calls["groups"] >= 2 * 7  # each iteration's transfers, in NCCL groups (M = 4: at least two)
        # each failed epoch, all together, and the last one at the end of training
        assert rank_calls["group_aborts"] == epochs and rank_calls["aborts"] >= 3 * epochs
    assert "NCCL communicators aborted in" in job.output
    assert ("NCCL communicators shrunk in" in job.output) is shrink
    assert ('"shrunk_groups": ["p2p", "norm"]' if shrink else '"shrunk_groups": []') in job.output  # the event


def test_a_received_tensor_is_waited_for_on_the_stream_and_the_host_checks_the_stream_every_few_waits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No CPU poll per transfer: the stream waits; every RUN_AHEAD waits the host polls an event on the stream, and a
    stream stuck behind a dead member becomes a PeerFailure there."""
    import ds_recycle.resilience.nccl as nccl

    class Event:
        stuck = False

        def record(self) -> None:
            pass

        def query(self) -> bool:
            return not Event.stuck
    monkeypatch.setattr(torch.cuda, "Event", Event)
    detector = Detector()
    comm = NcclEpochComm.build_nccl(dist.HashStore(), 1, [0, 1], [0], 0, 30.0, detector, GPU,
                                    connect=fake_connect(Calls()))
    works = [FakeWork(done_after=10**9) for _ in range(nccl.RUN_AHEAD - 1)]
    for work in works:  # never complete on the host's side: the stream waits, the host goes on
        comm.wait_on_stream(work, "receive")
    assert all(w.waited and w.polls == 0 for w in works)
    Event.stuck, detector.dead = True, True
    with pytest.raises(PeerFailure, match="the stream, at receive: rank 3 exited"):
        comm.wait_on_stream(FakeWork(), "receive")
    with pytest.raises(PeerFailure, match="remote process exited"):
        comm.wait_on_stream(FakeWork(error=RuntimeError("NCCL error: remote process exited")), "receive")


def test_the_watchdogs_trip_aborts_the_epoch_from_its_thread_only_if_the_training_thread_does_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import ds_recycle.resilience.nccl as nccl

    monkeypatch.setattr(nccl, "BACKSTOP_S", 0.05)
    for training_thread_retires in (False, True):
        calls = Calls()
        comm = NcclEpochComm.build_nccl(dist.HashStore(), 2, [0, 1], [0, 1], 1, 30.0, Detector(), GPU,
                                        connect=fake_connect(calls))
        for group in comm.groups:  # the watchdog breaks every group it guards
            group.break_links()
        if training_thread_retires:
            comm.retire()
        deadline = time.monotonic() + 5.0
        while comm.retired_in_s is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert [c[0] for c in calls.log].count("group_start") == 1, calls.log


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_restarted_worker_rejoins_on_the_nccl_path_and_the_members_retire_the_epoch_they_leave(
        tmp_path: Path, reference: Callable[[int, int, int], Path]) -> None:
    """The same stand-ins through a rejoin: (1, 0) killed at iteration 2, restarted by the launcher, builds the next
    epoch's NCCL groups with the members and takes its stage's state over them; the members shrink the failed epoch
    and, once it is in, retire the one they ran without it (on the shrunk communicators). The model is the
    failure-free one."""
    from tests.launcher.launch_harness import LaunchedJob

    steps = 100  # enough left after the kill to admit the restarted worker (the members pause while it starts)
    config = tiny_config(tmp_path, "nccl", 2, 2, failure_timeout_s=60.0, transport="nccl")
    out, calls = tmp_path / "final.pt", tmp_path / "calls"
    calls.mkdir()
    job = LaunchedJob(["--num_accelerators", "4", "--master_port", "0", "--restart_failed_after", "1",
                       "--max_restarts", "1", str(Path(__file__).parent / "_nccl_emulated_train.py"),
                       "--deepspeed_config", str(config), "--steps", str(steps), "--save-final", str(out),
                       "--kill", "1:0@2:forward"], env={"WANDB_MODE": "disabled", "NCCL_CALLS_DIR": str(calls),
                                                        "NCCL_STANDIN_SHRINK": "1",
                                                        "PYTHONPATH": str(Path(__file__).parents[2])})
    try:
        with job.members_paused(1, 1, [0, 2, 3]):
            pass
        job.wait_for(r"joined the running job at iteration \d+", timeout_s=200)
        assert job.finish(200) == 0, job.text[-4000:]
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    assert_same_model(out, reference(2, 2, steps))
    seen = {p.stem: json.loads(p.read_text()) for p in calls.glob("*.json")}
    for rank in (0, 2, 3):  # the failed epoch, the one without (1, 0) once it is back, the last one at the end
        assert seen[f"rank{rank}-life0"]["group_aborts"] == 3 and seen[f"rank{rank}-life0"]["shrinks"] == 2, seen
    assert seen["rank1-life1"]["communicators"] >= 3 and seen["rank1-life1"]["group_aborts"] == 1, seen


def test_an_operation_that_cannot_be_posted_on_an_aborted_communicator_is_a_peer_failure() -> None:
    """The watchdog's backstop may abort the epoch while the training thread posts: NCCL then refuses the operation,
    which is the failure being recovered from, not an error of the job (a sticky CUDA error stays one)."""
    calls = Calls()
    group = NcclGroup(dist.HashStore(), "e1/p2p", [0, 1], 0, 60.0, GPU, fake_connect(calls))

    def refuse(error: RuntimeError) -> Any:
        def call(*args: Any) -> None:
            raise error
        return call
    group.pg._start_coalescing = refuse(RuntimeError("NCCL communicator was aborted"))  # type: ignore[attr-defined]
    with pytest.raises(PeerFailure, match="group e1/p2p: 1 transfers: NCCL communicator was aborted"):
        group.post_p2p([(True, torch.zeros(1), 1)])
    group.pg.allreduce = refuse(RuntimeError("CUDA error: unspecified launch failure"))  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="unspecified launch failure") as raised:
        group.all_reduce_sum(torch.zeros(1))
    assert not isinstance(raised.value, PeerFailure)


def test_auto_takes_nccl_where_every_worker_has_a_gpu_of_its_own_and_gloo_elsewhere(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert epoch_device("auto", cpu, 1) is None and epoch_device("gloo", cpu, 1) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert epoch_device("auto", GPU, 1) == GPU and epoch_device("nccl", GPU, 1) == GPU
    assert epoch_device("auto", GPU, 2) is None and epoch_device("gloo", GPU, 1) is None  # shared: staged gloo
    with pytest.raises(ConfigError, match="2 workers on each GPU"):
        epoch_device("nccl", GPU, 2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert epoch_device("auto", GPU, 1) is None


def test_after_a_removal_the_survivors_shrink_what_lost_a_member_abort_the_epoch_together_and_build_the_rest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Kept at the failure (nothing done to NCCL), the epoch is shrunk once the members agree rank 1 is lost: p2p
    and norm without it, in that order; the stage group, left with one member, and the tied group, which lost
    none, are not; then every communicator of the epoch is aborted inside one NCCL group. The next epoch takes the
    shrunk p2p and norm, with their members numbered as NCCL numbers them, and builds the other two."""
    import ds_recycle.resilience.nccl as nccl

    calls = Calls()
    monkeypatch.setattr(nccl, "shrink_nccl", fake_shrink(calls))
    comm = NcclEpochComm.build_nccl(dist.HashStore(), 1, [0, 1, 2, 3], [1, 3], 3, 30.0, Detector(), GPU, "g0",
                                    {"embed": [0, 3]}, connect=fake_connect(calls, Shrinkable))
    calls.log.clear()
    assert comm.hold() and calls.log == []
    comm.p2p.break_links()  # the watchdog's trip: the kept epoch has its own, longer, backstop
    shrunk = comm.shrink([1])
    assert shrunk is not None and comm.retired_in_s is not None
    assert calls.log == [("shrink", "comm0", [1]), ("shrink", "comm1", [1]), ("group_start", "comm0"),
                         ("abort", "comm0"), ("abort", "comm1"), ("abort", "comm2"), ("abort", "comm3"),
                         ("group_end", "comm0")]
    assert comm.shrink([1]) is None and comm.hold() is False  # retired: nothing more
    calls.log.clear()
    after = NcclEpochComm.build_nccl(dist.HashStore(), 2, [0, 2, 3], [3], 3, 30.0, Detector(), GPU, "g0",
                                     {"embed": [0, 3]}, connect=fake_connect(calls, Shrinkable), shrunk=shrunk)
    assert [c[0] for c in calls.log] == ["connect", "connect"]  # the stage and tied groups only
    assert after.shrunk_roles == ("p2p", "norm") and shrunk.pairs == {}
    assert after.p2p.backend.name == "comm0-shrunk" and after.norm.backend.name == "comm1-shrunk"  # type: ignore
    assert after.p2p.index == {0: 0, 2: 1, 3: 2}
    after.p2p.send(torch.zeros(1), 2)
    assert calls.log[-2][:2] == ("comm0-shrunk", "send") and calls.log[-2][3] == 1  # rank 2 is index 1 now


def test_a_failed_shrink_aborts_what_it_made_and_the_epoch_and_an_epoch_not_shrunk_in_time_is_aborted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import ds_recycle.resilience.nccl as nccl

    calls = Calls()
    monkeypatch.setattr(nccl, "shrink_nccl", fake_shrink(calls, fails="comm1"))
    comm = NcclEpochComm.build_nccl(dist.HashStore(), 1, [0, 1, 2], [0, 1, 2], 0, 30.0, Detector(), GPU,
                                    connect=fake_connect(calls, Shrinkable))
    calls.log.clear()
    assert comm.hold() and comm.shrink([2]) is None
    assert calls.log == [("shrink", "comm0", [2]), ("shrink", "comm1", [2]),  # fails: the stage's is not tried
                         ("group_start", "comm0-shrunk"), ("abort", "comm0-shrunk"), ("group_end", "comm0-shrunk"),
                         ("group_start", "comm0"), ("abort", "comm0"), ("abort", "comm1"), ("abort", "comm2"),
                         ("group_end", "comm0")]
    monkeypatch.setattr(nccl, "SHRINK_WINDOW_S", 0.05)
    for backend in (Shrinkable, FakeBackend):  # kept, then aborted by its backstop; or not shrinkable: at once
        calls.log.clear()
        comm = NcclEpochComm.build_nccl(dist.HashStore(), 1, [0, 1], [0, 1], 0, 30.0, Detector(), GPU,
                                        connect=fake_connect(calls, backend))
        assert comm.hold() is (backend is Shrinkable)
        deadline = time.monotonic() + 5.0
        while comm.retired_in_s is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert comm.retired_in_s is not None and comm.shrink([1]) is None
        assert [c[0] for c in calls.log].count("group_start") == 1
    # a member whose epoch is gone (its backstop aborted it) makes every member build afresh: none starts a shrink
    calls.log.clear()
    comm = NcclEpochComm.build_nccl(dist.HashStore(), 1, [0, 1, 2], [0, 1, 2], 0, 30.0, Detector(), GPU,
                                    connect=fake_connect(calls, Shrinkable))
    said: list[bool] = []
    assert comm.hold() and comm.shrink([2], lambda kept: said.append(kept) or False) is None
    assert said == [True] and "shrink" not in [c[0] for c in calls.log] and comm.retired_in_s is not None


def test_the_next_epoch_takes_the_shrunk_communicators_only_if_every_member_kept_its_epoch_and_shrank_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's side of the two votes of a 3-rank epoch that lost rank 1 (rank 2's answers are in the store)."""
    from types import SimpleNamespace
    from typing import cast

    import ds_recycle.resilience.nccl as nccl

    class Watchdog:
        lost: set[int] = set()

        def dead(self, rank: int) -> bool:
            return rank in self.lost
    calls, store, watchdog = Calls(), dist.HashStore(), Watchdog()
    monkeypatch.setattr(nccl, "shrink_nccl", fake_shrink(calls))
    job = Job(store, StoreKeys(), 0, 0, 5.0, cast(Any, watchdog), cast(Any, None), 0, (), GPU)

    def failed(number: int, kept: str | None, done: str | None, shrink: bool = True) -> ShrunkGroups | None:
        comm = NcclEpochComm.build_nccl(dist.HashStore(), number - 1, [0, 1, 2], [0, 1, 2], 0, 30.0, Detector(), GPU,
                                        connect=fake_connect(calls, Shrinkable))
        for question, answer in (("kept", kept), ("done", done)):
            if answer is not None:
                store.set(StoreKeys().shrink_vote(question, number, 2), answer)
        assert comm.hold()
        calls.log.clear()
        agreement = Agreement(number, (0, 2), (1,), {}, None, 0.0)
        return shrink_failed(job, cast(Any, SimpleNamespace(comm=comm)), agreement, shrink)

    shrunk = failed(1, "1", "1")  # all kept, all shrank: taken
    assert shrunk is not None and sorted(shrunk.pairs) == [("norm", (0, 2)), ("p2p", (0, 2)), ("stage", (0, 2))]
    assert [c[0] for c in calls.log].count("shrink") == 3
    assert failed(2, "1", "0") is None  # rank 2's shrink failed: this one's are aborted
    assert [c[1] for c in calls.log if c[0] == "abort"] == ["comm0", "comm1", "comm2",  # the epoch, then its children
                                                            "comm0-shrunk", "comm1-shrunk", "comm2-shrunk"]
    assert failed(3, "0", "0") is None and "shrink" not in [c[0] for c in calls.log]  # rank 2 no longer had it
    watchdog.lost = {2}
    assert failed(4, None, None) is None and "shrink" not in [c[0] for c in calls.log]  # lost before it answered
    assert failed(5, None, None, shrink=False) is None  # recycle.nccl_shrink off: retired, nothing asked
    assert [c[0] for c in calls.log] == ["group_start", "abort", "abort", "abort", "group_end"]
    assert not store.check([StoreKeys().shrink_vote("kept", 5, 0)])
    # a member whose first groups never built has no epoch to shrink: it says so, and the others build afresh
    watchdog.lost = set()
    store.set(StoreKeys().shrink_vote("kept", 6, 2), "1")
    store.set(StoreKeys().shrink_vote("done", 6, 2), "1")
    assert shrink_failed(job, None, Agreement(6, (0, 2), (1,), {}, None, 0.0), True) is None
    assert store.get(StoreKeys().shrink_vote("kept", 6, 0)) == b"0"
