"""Pure helpers of the failure demo and the goodput benchmark: /proc parsing, worker pid discovery, metrics
lives, goodput arithmetic, the failure list. No processes are started except the one pid-discovery test."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ds_recycle.events import Event, EventError, FailureEvent, FallbackEvent, RejoinEvent, events_of
from ds_recycle.tools.goodput import (
    Failure,
    checkpoint_cost,
    latest_checkpoint,
    parse_failures,
    progress,
    steady_rate,
)
from ds_recycle.tools.jobs import MetricsTail, rank_of
from ds_recycle.tools.procs import ProcInfo, descendants, parse_environ, parse_stat, rank_pids, worker_pids


def test_parse_stat_survives_spaces_and_parentheses_in_the_command_name() -> None:
    assert parse_stat("4242 (python3 (x) y) S 17 4242 4242 0 -1") == (4242, 17)
    with pytest.raises(ValueError, match="stat"):
        parse_stat("garbage")


def test_parse_environ_splits_on_nul_and_keeps_equals_in_values() -> None:
    env = parse_environ(b"RANK=3\0PATH=/a:/b\0X=a=b\0\0BROKEN\0")
    assert env == {"RANK": "3", "PATH": "/a:/b", "X": "a=b"}


def _tree() -> dict[int, ProcInfo]:
    # 10 launcher -> 11 launch.py -> 20..23 workers (RANK 0..3); worker 21 has a helper child 30 (inherits RANK 1);
    # 40 is a zombie (environ unreadable: rank None); 99 is an unrelated process with RANK 0.
    procs = [ProcInfo(10, 1, None), ProcInfo(11, 10, None), ProcInfo(30, 21, 1), ProcInfo(40, 11, None),
             ProcInfo(99, 1, 0)] + [ProcInfo(20 + r, 11, r) for r in range(4)]
    return {p.pid: p for p in procs}


def test_rank_pids_takes_the_topmost_process_of_each_rank_under_the_launcher_only() -> None:
    assert rank_pids(_tree(), 10) == {0: 20, 1: 21, 2: 22, 3: 23}
    assert set(descendants(_tree(), 10)) == {11, 20, 21, 22, 23, 30, 40}
    assert rank_pids(_tree(), 21) == {}  # the helper inherits its parent's RANK: not a worker of its own


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(30)
def test_worker_pids_finds_a_real_child_by_its_rank() -> None:
    code = ("import os, subprocess, sys, time\n"
            "kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'], "
            "env={**os.environ, 'RANK': '5'})\n"
            "print(kid.pid, flush=True); time.sleep(30)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={k: v for k, v in os.environ.items() if k != "RANK"}, start_new_session=True)
    try:
        assert parent.stdout is not None
        kid = int(parent.stdout.readline())
        deadline = time.monotonic() + 20.0  # the child shows RANK once it has exec'd (on a busy machine, later)
        while worker_pids(parent.pid) != {5: kid} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker_pids(parent.pid) == {5: kid}
    finally:
        os.killpg(parent.pid, 9)
        parent.wait()


def _rec(it: int, t: float, step: float = 1.0, events: list | None = None) -> dict:
    return {"iter": it, "unix_time": t, "iter_time_s": step, "events": events or []}


def test_metrics_tail_splits_lives_when_the_file_is_written_anew(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    tail = MetricsTail(path)
    assert tail.poll() == [] and tail.last is None
    path.write_text("".join(json.dumps(_rec(i, i)) + "\n" for i in range(6)) + '{"iter": 6, "unix')  # partial line
    assert [r["iter"] for r in tail.poll()] == list(range(6))
    with open(path, "a") as f:
        f.write('_time": 6, "iter_time_s": 1}\n')
    assert [r["iter"] for r in tail.poll()] == [6]
    path.write_text(json.dumps(_rec(5, 20)) + "\n")  # a restarted reporter: shorter file, from the checkpoint on
    tail.poll()
    assert [[r["iter"] for r in life] for life in tail.lives] == [list(range(7)), [5]]
    assert tail.last is not None and tail.last["iter"] == 5


def test_progress_running_job_keeps_its_iterations_a_dead_one_rolls_back_to_its_checkpoint() -> None:
    first = [_rec(i, i) for i in range(12)]    # died after iteration 11; checkpoint at 10
    second = [_rec(i, 20 + i) for i in range(10, 17)]
    running = progress([first, second], running=True, checkpoint=15)
    assert (running.committed, running.finished, running.lost, running.lives) == (17, 19, 2, 2)
    down = progress([first, second, []], running=True, checkpoint=15)  # restarted, still starting up
    assert (down.committed, down.lost) == (15, 4)
    killed = progress([first, second], running=False, checkpoint=15)
    assert killed.committed == 15
    with pytest.raises(ValueError, match="committed"):
        progress([[_rec(30, 0)]], running=True, checkpoint=0)


def test_steady_rate_leaves_out_the_first_iteration_and_what_follows_the_failure() -> None:
    records = [_rec(0, 10.0)] + [_rec(i, 10.0 + 2 * i) for i in range(1, 8)]
    assert steady_rate(records) == pytest.approx(0.5)
    assert steady_rate(records, before=15.0) == pytest.approx(0.5)  # iterations 1 and 2 only
    assert steady_rate(records[:2]) is None


def test_checkpoint_cost_is_the_extra_gap_after_checkpoint_iterations() -> None:
    # one step = 1 s, 0.1 s of overhead per record, 0.5 s more after iterations 4 and 9 (checkpoint every 5)
    t, records = 0.0, []
    for it in range(12):
        t += 1.0 + 0.1 + (0.5 if it in (5, 10) else 0.0)
        records.append(_rec(it, t))
    assert checkpoint_cost(records, 5) == pytest.approx(0.5)
    assert checkpoint_cost(records, 0) is None and checkpoint_cost(records[:3], 5) is None


def _rejoin(t: float) -> dict:
    return RejoinEvent(time_s=t, ranks=(2,), workers=((1, 0),), iteration=4, members=(0, 1, 2, 3), join_s=0.5,
                       state_bytes=10).to_dict()


def test_events_and_latest_checkpoint() -> None:
    failure = FailureEvent(time_s=1, lost_ranks=(2,), lost_workers=((1, 0),), reason="rank 2 exited", epoch=1)
    lives = [[_rec(0, 0, events=[failure.to_dict()]), _rec(1, 1, events=[_rejoin(5)])], [_rec(0, 9, events=[_rejoin(9)])]]
    assert [e.time_s for e in events_of(lives, RejoinEvent)] == [5, 9]
    assert [e.lost_ranks for e in events_of(lives, FailureEvent)] == [(2,)]
    with pytest.raises(EventError, match="redo_iteration"):  # a record that no longer fits its definition
        events_of([_rec(0, 0, events=[{**_rejoin(1), "redo_iteration": 3}])], RejoinEvent)
    assert latest_checkpoint("iter15\n") == 15 and latest_checkpoint(None) == 0
    with pytest.raises(ValueError, match="iter<N>"):
        latest_checkpoint("global_step7")


def test_parse_failures_sorts_and_rejects_bad_items_with_the_fix() -> None:
    assert parse_failures("90:1:1, 45:1:0", stages=2, pipelines=2) == [Failure(45, 1, 0), Failure(90, 1, 1)]
    for bad, match in [("45:1", "SECONDS:PIPELINE:STAGE"), ("x:1:0", "SECONDS"), ("45:2:0", "pipeline in 0..1"),
                       ("45:0:1", "reports the metrics"), ("", "at least one"), ("45:1:0:3", "SECONDS")]:
        with pytest.raises(ValueError, match=match):
            parse_failures(bad, stages=2, pipelines=2)


def test_rank_of_is_deepspeeds_stage_major_layout() -> None:
    assert [rank_of(p, s, 2) for s in range(2) for p in range(2)] == [0, 1, 2, 3]
    assert rank_of(1, 2, 3) == 7


def test_caught_signals_reads_the_sigcgt_mask() -> None:
    from ds_recycle.tools.procs import caught_signals

    status = "Name:\tpython3\nSigBlk:\t0000000000000000\nSigCgt:\t0000000180000202\n"
    assert caught_signals(status) == frozenset({2, 10, 32, 33})  # SIGINT, SIGUSR1, and two real-time signals
    with pytest.raises(ValueError, match="SigCgt"):
        caught_signals("Name:\tx\n")


def test_fallback_times_reads_the_workers_event_lines_once_per_event() -> None:
    from ds_recycle.tools.goodput import fallback_times

    def line(rank: int, event: Event) -> str:
        return f"[rank {rank}] 20:08:22 WARNING ds_recycle.resilience.handler: event {json.dumps(event.to_dict())}\n"

    log = (line(1, FallbackEvent(time_s=1796069302.99, reason="stage 0 lost", generation=1, directory="c"))
           + line(3, FallbackEvent(time_s=1796069303.01, reason="stage 0 lost", generation=1, directory="c"))
           + line(3, FailureEvent(time_s=1796069300.0, lost_ranks=(0,), lost_workers=((0, 0),), reason="x", epoch=1)))
    assert fallback_times(log) == [1796069302.99]
    assert fallback_times("") == []


def test_rss_bytes_reads_vmrss_in_kib() -> None:
    from ds_recycle.tools.procs import rss_bytes

    assert rss_bytes("Name:\tpython\nVmRSS:\t  438908 kB\nVmSwap:\t0 kB\n") == 438908 * 1024
    assert rss_bytes("Name:\tzombie\n") == 0
