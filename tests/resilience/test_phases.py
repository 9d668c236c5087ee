"""The failure handler's parts that need no process: detection's words, the production check, where faults fire."""
from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from ds_recycle.engine import instructions as ins
from ds_recycle.resilience.errors import PeerFailure
from ds_recycle.resilience.faults import FaultSpec, Phase
from ds_recycle.resilience.handler import _FailureCheck
from ds_recycle.resilience.injection import Faults, kill_time
from ds_recycle.resilience.phases import HandlerState, detect
from ds_recycle.resilience.store import StoreKeys


class _Detector:
    def __init__(self, reason: str = "") -> None:
        self._reason = reason

    def failed(self) -> bool:
        return bool(self._reason)

    def tripped(self) -> bool:
        return bool(self._reason)

    def reason(self) -> str:
        return self._reason or "a worker exited"


def test_detection_adds_the_watchdogs_finding_only_when_the_wait_lacks_it() -> None:
    found = "rank 2 hung: no heartbeat for 10.1 s"
    seen = detect(PeerFailure("epoch 0: stage gradient all-reduce: Connection closed"), _Detector(found), 0, [0, 1, 2])
    assert seen.reason.endswith(f"; watchdog: {found}") and seen.epoch == 0 and seen.members == (0, 1, 2)
    assert detect(PeerFailure(f"x: {found}"), _Detector(found), 3, [0]).reason == f"x: {found}"
    assert detect(PeerFailure("receive: timeout"), _Detector(), 1, [0]).reason == "receive: timeout"


def test_the_production_check_raises_between_instructions_once_a_member_failed() -> None:
    quiet, tripped = _FailureCheck(_Detector()), _FailureCheck(_Detector("rank 1 exited"))
    quiet.before_instruction(ins.WaitSends())
    quiet.before_step()
    with pytest.raises(PeerFailure, match="seen between instructions"):
        tripped.before_instruction(ins.WaitSends())


class _Engine:
    iteration = 4

    def _train_schedule(self) -> Any:
        raise AssertionError("the schedule is read only while a last-backward-weight fault waits")


def test_faults_arm_only_the_worker_they_aim_at_and_only_in_their_life() -> None:
    store = dist.HashStore()
    specs = [FaultSpec(1, 0, 4, Phase.FORWARD), FaultSpec(1, 0, 1, Phase.JOIN_REQUEST)]
    aimed = Faults(specs, (1, 0), 0, store, StoreKeys(), 2, _Engine())  # type: ignore[arg-type]
    other = Faults(specs, (0, 0), 0, store, StoreKeys(), 0, _Engine())  # type: ignore[arg-type]
    restarted = Faults(specs, (1, 0), 1, store, StoreKeys(), 2, _Engine())  # type: ignore[arg-type]
    assert aimed.armed and not other.armed
    assert not restarted.training.pending and [f.phase for f in restarted.joining.pending] == [Phase.JOIN_REQUEST]
    check = _FailureCheck(_Detector())
    assert other.hooks(check) is not check  # wrapping is the handler's choice: it wraps only an armed worker
    aimed.fire(Phase.BACKWARD_INPUT)  # not this phase: nothing happens
    aimed.fire_join(Phase.JOIN_REQUEST)  # a join fault of another life: nothing happens
    assert kill_time(store, StoreKeys(), 2) is None


def test_the_handler_states_name_every_phase_of_a_recovery() -> None:
    assert [s.value for s in HandlerState][:3] == ["starting", "joining", "training"]
    assert {"detected", "agreeing", "regrouping", "deciding", "installing", "resuming"} <= {s.value for s in
                                                                                           HandlerState}

