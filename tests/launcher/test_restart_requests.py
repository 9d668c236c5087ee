"""The rule for restarts on command, as a plain function over a rank's state, and the answer's encoding."""
from __future__ import annotations

from dataclasses import replace

import pytest

from ds_recycle.launcher.policy import ExitPolicy
from ds_recycle.launcher.restart_requests import (
    RankState,
    Refusal,
    RestartResult,
    explain_refusal,
    judge_restart_request,
    new_request_id,
)
from ds_recycle.launcher.worker import WorkerExit

POLICY = ExitPolicy(max_restarts=2)


def _exit(code: int, restarts: int = 0) -> WorkerExit:
    return WorkerExit("rank 3", 3, 4321, code, 2.0, restarts, stopped_by_launcher=False)


LOST = RankState(rank=3, running_pid=None, last_exit=_exit(-9), restart_count=0)


@pytest.mark.parametrize("state, refusal", [
    (LOST, None),
    (replace(LOST, last_exit=_exit(75)), None),  # exit code 75 declares the rank lost
    (replace(LOST, last_exit=_exit(-9, 1), restart_count=1), None),  # restart 2 of at most 2
    (replace(LOST, running_pid=555), Refusal.RUNNING),
    (replace(LOST, last_exit=None), Refusal.RUNNING),  # started, not exited (or not started yet)
    (replace(LOST, restart_due_in_s=1.5), Refusal.RESTART_DUE),
    (replace(LOST, last_exit=_exit(0)), Refusal.FINISHED),
    (replace(LOST, last_exit=_exit(1)), Refusal.FAILED),
    (replace(LOST, last_exit=_exit(-9, 2), restart_count=2), Refusal.OUT_OF_RESTARTS),
    (replace(LOST, job_stopping="stop requested in the store"), Refusal.JOB_STOPPING),
])
def test_judge(state: RankState, refusal: Refusal | None) -> None:
    assert judge_restart_request(state, POLICY) is refusal


def test_max_restarts_zero_refuses_every_restart() -> None:
    assert judge_restart_request(LOST, ExitPolicy(max_restarts=0)) is Refusal.OUT_OF_RESTARTS


@pytest.mark.parametrize("state, words", [
    (replace(LOST, running_pid=555), ["rank 3 is running as pid 555", "only a rank whose process is gone"]),
    (replace(LOST, restart_due_in_s=1.54), ["restarted automatically in 1.5 s", "--restart_failed_after"]),
    (replace(LOST, last_exit=_exit(0)), ["rank 3 finished (exit code 0)"]),
    (replace(LOST, last_exit=_exit(2)), ["error (exit code 2)", "exit code 75"]),
    (replace(LOST, restart_count=2), ["restarted 2 time(s) already", "--max_restarts 2", "higher --max_restarts"]),
    (replace(LOST, job_stopping="the launcher received SIGTERM"), ["being stopped (the launcher received SIGTERM)"]),
])
def test_every_refusal_is_explained(state: RankState, words: list[str]) -> None:
    refusal = judge_restart_request(state, POLICY)
    assert refusal is not None
    text = explain_refusal(refusal, state, POLICY)
    for word in words:
        assert word in text


@pytest.mark.parametrize("result", [
    RestartResult("h:1:2", 3, None, "restarted as pid 99 (restart 1 of at most 2)", 99, 1),
    RestartResult("h:1:3", 0, Refusal.OUT_OF_RESTARTS, "rank 0 was restarted 2 time(s) already", None, 2),
])
def test_result_round_trip(result: RestartResult) -> None:
    back = RestartResult.decode(result.encode())
    assert back == result
    assert back.restarted is (result.refusal is None)


@pytest.mark.parametrize("text", ["", "not json", '{"request_id": "x"}', '{"request_id": "x", "rank": 0, '
                                  '"refusal": "bored", "message": "", "pid": null, "restart_count": 0}'])
def test_bad_result_text_is_named(text: str) -> None:
    with pytest.raises(ValueError, match="not a restart result"):
        RestartResult.decode(text)


def test_request_ids_differ() -> None:
    assert new_request_id() != new_request_id()
