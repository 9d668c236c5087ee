"""``launch/train.py`` with ``recycle.transport: "nccl"`` on CPU: the NCCL epoch groups' code (resilience/nccl.py)
over gloo communicators that stand in for NCCL's, so that a job runs the whole NCCL path of the failure handler
(epoch groups built per epoch, a step's transfers posted as one group, polled waits, the epoch retired by a group
abort before the survivors regroup) where this CPU build of torch has no NCCL.

What the stand-in cannot show is NCCL itself: its "abort" fails the communicator's pending and later waits (as
NCCL's does) but leaves gloo's operations as they are, and a wait on the stream is a wait of the host; a worker
blocked there is released when the watchdog trips (where NCCL's host would see the detector between its polls of
the stream). With ``NCCL_STANDIN_SHRINK=1`` the communicators can be shrunk: a shrink aborts the parent and
connects a gloo group among the members left (collective among them, as ``ncclCommShrink`` is). Each worker writes
the calls it saw to ``$NCCL_CALLS_DIR``.
"""
from __future__ import annotations

import json
import os
import runpy
import sys
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import ds_recycle.resilience.handler as handler  # noqa: E402
import ds_recycle.resilience.nccl as nccl  # noqa: E402

CALLS: dict[str, int] = {"communicators": 0, "groups": 0, "group_aborts": 0, "aborts": 0, "shrinks": 0}


def _dump() -> None:
    folder = os.environ.get("NCCL_CALLS_DIR")
    if folder:
        life = os.environ.get("DS_RECYCLE_RESTART_COUNT", "0")
        (Path(folder) / f"rank{os.environ['RANK']}-life{life}.json").write_text(json.dumps(CALLS))


class AllOf:
    """The work of a coalesced group: complete once each of its operations is, or failed once its communicator is
    aborted (as an NCCL work is). gloo's point-to-point works complete only inside their ``wait()``, so a thread waits
    for them and the group reports that thread's end."""

    def __init__(self, works: list[Any], aborted: threading.Event, tripped: threading.Event) -> None:
        self.error: BaseException | None = None
        self.aborted, self.tripped = aborted, tripped
        self.thread = threading.Thread(target=self._wait_all, args=(works,), daemon=True)
        self.thread.start()

    def _wait_all(self, works: list[Any]) -> None:
        try:
            for w in works:
                w.wait()
        except BaseException as e:  # noqa: BLE001 - raised by wait()
            self.error = e

    def is_completed(self) -> bool:
        return not self.thread.is_alive() or self.aborted.is_set()

    def wait(self) -> bool:
        while self.thread.is_alive():
            if self.aborted.is_set():
                raise RuntimeError("NCCL communicator was aborted")
            if self.tripped.is_set():
                raise RuntimeError("the watchdog tripped while the stream waited")
            self.thread.join(0.01)
        if self.error is not None:
            raise RuntimeError(str(self.error)) from self.error
        return True


class DoneEvent:
    """A CUDA event on a machine without CUDA: the stand-in's transfers are done when their wait returns."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True


class CoalescingGloo:
    """A gloo group with NCCL's coalescing calls: what is posted between them is one work."""

    def __init__(self, gloo: Any, aborted: threading.Event) -> None:
        self.gloo = gloo
        self.aborted, self.tripped = aborted, threading.Event()
        self.open: list[Any] | None = None

    def _start_coalescing(self, device: torch.device) -> None:
        if self.aborted.is_set():  # NCCL refuses work on an aborted communicator
            raise RuntimeError("NCCL communicator was aborted")
        self.open = []

    def _end_coalescing(self, device: torch.device) -> AllOf:
        works, self.open = self.open or [], None
        CALLS["groups"] += 1
        _dump()  # the worker may leave with os._exit: what it saw is on disk as it goes
        return AllOf(works, self.aborted, self.tripped)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        return self._kept(self.gloo.send(tensors, dst, tag))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        return self._kept(self.gloo.recv(tensors, src, tag))

    def _kept(self, work: Any) -> Any:
        if self.open is not None:
            self.open.append(work)
        return work

    def __getattr__(self, name: str) -> Any:  # the collectives: gloo's own
        return getattr(self.gloo, name)


class AbortRecorder:
    """The backend's abort calls: counted, and every work of the communicator fails from then on."""

    supports_shrinking = os.environ.get("NCCL_STANDIN_SHRINK") == "1"

    def __init__(self, index: int, size: int, timeout_s: float) -> None:
        self.aborted = threading.Event()
        self.index, self.size, self.timeout_s = index, size, timeout_s

    def _group_start(self) -> None:
        CALLS["group_aborts"] += 1
        _dump()

    def _group_end(self) -> None:
        _dump()

    def abort(self) -> None:
        CALLS["aborts"] += 1
        self.aborted.set()


def connect(store: dist.Store, index: int, size: int, timeout_s: float, device: torch.device) -> tuple[Any, Any]:
    from datetime import timedelta

    CALLS["communicators"] += 1
    _dump()
    gloo = dist.ProcessGroupGloo(store, index, size, timedelta(seconds=timeout_s))
    backend = AbortRecorder(index, size, timeout_s)
    return backend, CoalescingGloo(gloo, backend.aborted)


def shrink(parent: AbortRecorder, store: dist.Store, excluded: list[int]) -> tuple[Any, Any]:
    from datetime import timedelta

    CALLS["shrinks"] += 1
    _dump()
    parent.aborted.set()  # SHRINK_ABORT: the parent's pending operations end first
    index = parent.index - sum(e < parent.index for e in excluded)
    size = parent.size - len(excluded)
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("shrunk/", store), index, size, timedelta(seconds=parent.timeout_s))
    child = AbortRecorder(index, size, parent.timeout_s)
    return child, CoalescingGloo(gloo, child.aborted)


_backstop = nccl.NcclEpochComm.backstop


def backstop(comm: nccl.NcclEpochComm) -> None:
    """The watchdog tripped: the epoch's waits end (see the module docstring), and NCCL's backstop is armed."""
    for group in comm.groups:
        group.pg.tripped.set()  # type: ignore[attr-defined]
    _backstop(comm)


nccl.NcclEpochComm.backstop = backstop  # type: ignore[method-assign]
nccl.connect_nccl = connect  # type: ignore[assignment]
nccl.shrink_nccl = shrink  # type: ignore[assignment]
torch.cuda.Event = DoneEvent  # type: ignore[misc, assignment]
handler.epoch_device = lambda transport, device, sharing: device  # type: ignore[assignment]  # the CPU here
sys.argv[0] = str(REPO / "launch" / "train.py")
try:
    runpy.run_path(str(REPO / "launch" / "train.py"), run_name="__main__")
finally:
    _dump()
