"""The exit rules as plain functions: what happens after one exit, and the job's status."""
from __future__ import annotations

import pytest

from ds_recycle.launcher.policy import Action, ExitPolicy, decide, job_status
from ds_recycle.launcher.worker import ExitKind, WorkerExit, exit_kind


def _exit(code: int, restarts: int = 0, rank: int | None = 1) -> WorkerExit:
    return WorkerExit("rank 1", rank, 1234, code, 1.0, restarts, stopped_by_launcher=False)


@pytest.mark.parametrize("code, kind", [(0, ExitKind.FINISHED), (-9, ExitKind.LOST), (-15, ExitKind.LOST),
                                        (75, ExitKind.LOST), (1, ExitKind.ERROR), (2, ExitKind.ERROR)])
def test_exit_kinds(code: int, kind: ExitKind) -> None:
    assert exit_kind(code) is kind


def test_default_policy() -> None:
    policy = ExitPolicy()
    assert decide(_exit(0), policy) is Action.CONTINUE
    assert decide(_exit(-9), policy) is Action.CONTINUE  # survivors are never stopped for a loss
    assert decide(_exit(1), policy) is Action.STOP_AFTER_GRACE


def test_strict_policy_stops_on_any_death() -> None:
    policy = ExitPolicy(strict=True, restart_after_s=1.0)
    assert decide(_exit(0), policy) is Action.CONTINUE
    assert decide(_exit(-9), policy) is Action.STOP_NOW
    assert decide(_exit(1), policy) is Action.STOP_NOW


def test_restarts_are_bounded_and_only_for_losses() -> None:
    policy = ExitPolicy(restart_after_s=0.5, max_restarts=2)
    assert decide(_exit(-9, restarts=0), policy) is Action.RESTART
    assert decide(_exit(75, restarts=1), policy) is Action.RESTART
    assert decide(_exit(-9, restarts=2), policy) is Action.CONTINUE
    assert decide(_exit(1, restarts=0), policy) is Action.STOP_AFTER_GRACE
    assert decide(_exit(-9, rank=None), policy) is Action.CONTINUE  # a remote node's launcher is not restarted


def test_job_status() -> None:
    assert job_status({0: 0, 1: 0}, strict=False) == 0
    assert job_status({0: 0, 1: -9}, strict=False) == 0  # a tolerated loss
    assert job_status({0: 0, 1: -9}, strict=True) == 1
    assert job_status({0: 0, 1: 1}, strict=False) == 1  # an error
    assert job_status({0: -9, 1: -9}, strict=False) == 1  # nobody finished
    assert job_status({0: -9, 1: -9}, strict=False, require_finished=False) == 0
    assert job_status({0: 0, 1: None}, strict=False) == 1  # a rank never reported


def test_bad_policy_values() -> None:
    with pytest.raises(ValueError, match="error_grace_s=-1"):
        ExitPolicy(error_grace_s=-1)
    with pytest.raises(ValueError, match="--max_restarts -1"):
        ExitPolicy(max_restarts=-1)
