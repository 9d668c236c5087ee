"""A worker SIGKILLed from outside while the job starts (importing, while DeepSpeed builds its groups and engine,
right after ``ds_recycle.initialize``): the job starts again (every rank, as the next generation) or recovers, then
trains and ends at the failure-free model bit for bit. Before the start-up restart existed, the others blocked in
gloo's group creation until its timeout and the job failed with no model.

Pure parts (who asks for the restart, and when it is refused) run on a ``HashStore``.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from ds_recycle.runtime import job_store as keys  # noqa: E402
from tests.harness import assert_same_model, tiny_config  # noqa: E402

STEPS = 7
"""As ``test_survival.py``: the failure-free reference is shared."""
KILLED_RANK = 1

# ------------------------------------------------------------------------------------------------ pure parts


def test_start_up_restart_asked_once_per_generation_and_never_after_the_start_up() -> None:
    store = dist.HashStore()
    assert keys.request_start_up_restart(store, 0)
    assert keys.generation(store) == 1 and keys.read_int(store, keys.RESTART_ALL_KEY) == 1
    assert store.check([keys.start_up_restart_key(1)])
    assert not keys.request_start_up_restart(store, 0), "a rank of generation 0 killed by the restart itself"
    store.set(keys.started_key(1), "1")
    assert not keys.request_start_up_restart(store, 1), "generation 1 is past its start-up: handlers recover"
    assert keys.generation(store) == 1


def test_handshake_restarts_a_ds_recycle_start_up_whichever_side_comes_first() -> None:
    """A death seen by a launcher before any rank said the job runs ds_recycle is found by the first rank that says
    it; one seen after is acted on by the launcher; a plain script's deaths restart nothing."""
    early = dist.HashStore()
    assert not keys.note_start_up_death(early, 0), "nothing says yet that this is a ds_recycle job"
    assert keys.generation(early) == 0
    assert keys.begin_resilient_start_up(early, 0) and keys.generation(early) == 1
    late = dist.HashStore()
    assert not keys.begin_resilient_start_up(late, 0)
    assert keys.note_start_up_death(late, 0) and keys.generation(late) == 1
    plain = dist.HashStore()
    for _ in range(3):
        assert not keys.note_start_up_death(plain, 0)
    assert keys.generation(plain) == 0
    over = dist.HashStore()
    keys.begin_resilient_start_up(over, 0)
    over.set(keys.started_key(0), "1")
    assert not keys.note_start_up_death(over, 0), "after the start-up the failure handlers recover"


def test_start_up_restart_of_a_fallback_generation_resumes_from_the_same_checkpoint() -> None:
    from ds_recycle.resilience.fallback import carried_events, carry_events, fallback_directory, hand_over_directory

    store = dist.HashStore()
    store.set(keys.GENERATION_KEY, "1")  # the job fell back to its checkpoint as generation 1 ...
    hand_over_directory(store, 1, "/ckpt")
    carry_events(store, 1, True, [{"kind": "fallback"}])
    assert keys.request_start_up_restart(store, 1)  # ... and a rank died while generation 1 started
    assert fallback_directory(store, 2) == "/ckpt" and carried_events(store, 2) == [{"kind": "fallback"}]


# ------------------------------------------------------------------------------------------------ real jobs


def _launch_and_kill(tmp: Path, marker: str, delay_s: float, preload: str,
                     timeout_s: float = 240.0) -> tuple[int, str, float]:
    """Run the 2 x 2 job; ``delay_s`` after the first output line containing ``marker``, SIGKILL rank 1's process.
    Returns the launcher's exit code, the output and when (s after the launch) the kill came."""
    config = tiny_config(tmp, "c", 2, 2, failure_timeout_s=60.0)
    cmd = [sys.executable, "-m", "ds_recycle", "launch", "--num_accelerators", "4", "--master_port", "0",
           "--preload", preload, str(REPO / "launch" / "train.py"), "--deepspeed_config", str(config), "--steps", str(STEPS),
           "--save-final", str(tmp / "final.pt")]
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    limit = threading.Timer(timeout_s, lambda: os.killpg(proc.pid, signal.SIGKILL))
    limit.start()
    lines: list[str] = []
    pid: int | None = None
    killed_at: list[float] = []

    def kill(victim: int) -> None:
        killed_at.append(time.monotonic() - t0)
        os.kill(victim, signal.SIGKILL)

    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            found = re.search(rf"started rank {KILLED_RANK} as pid (\d+)", line)
            if found and pid is None:
                pid = int(found.group(1))
            if marker in line and pid is not None and not killed_at:
                killed_at.append(-1.0)  # armed
                threading.Timer(delay_s, kill, (pid,)).start()
        proc.wait(10)
    finally:
        limit.cancel()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing of the job may outlive the test
        except ProcessLookupError:
            pass
    out = "".join(lines)
    assert time.monotonic() - t0 < timeout_s, f"the job did not end within {timeout_s} s\n{out[-5000:]}"
    assert killed_at and killed_at[-1] >= 0, f"rank {KILLED_RANK} was never killed (marker {marker!r})\n{out[-3000:]}"
    return proc.returncode, out, killed_at[-1]


# (what the victim was doing, the output line that arms the kill, the delay). Without the fork server (``--preload
# off``, as on CUDA machines) each worker imports torch and DeepSpeed itself, which takes seconds: the start-up is
# long enough to be hit from outside where intended.
MOMENTS = [
    ("importing torch and DeepSpeed", f"started rank {KILLED_RANK} as pid", 0.5),
    ("building DeepSpeed's groups and engine", "Using topology", 0.0),
]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("moment", "marker", "delay_s"), MOMENTS, ids=[m[0].split()[0] for m in MOMENTS])
def test_death_during_start_up_starts_the_job_again_same_model(
        tmp_path: Path, reference: Callable[[int, int, int], Path], moment: str, marker: str, delay_s: float) -> None:
    code, out, killed_s = _launch_and_kill(tmp_path, marker, delay_s, "off")
    assert code == 0, out[-5000:]
    # said by the launcher that saw the death, or by the first rank that began its start-up after it
    assert "lost during the start-up of generation 0: every rank starts again" in out, out[-5000:]
    print(f"killed {killed_s:.1f} s after the launch ({moment}): job started again and finished")
    assert_same_model(tmp_path / "final.pt", reference(2, 2, STEPS))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_death_right_after_initialize_is_survived_same_model(
        tmp_path: Path, reference: Callable[[int, int, int], Path]) -> None:
    """Forked from the fork server (the CPU default), a worker is past ``ds_recycle.initialize`` about half a second
    after it starts: killed then, the start-up may be over or not (either path is right: a start-up restart, or
    recovery by the failure handlers); the job ends at the same model."""
    code, out, _ = _launch_and_kill(tmp_path, f"started rank {KILLED_RANK} as pid", 0.5, "auto")
    assert code == 0, out[-5000:]
    restarted = "was lost during the start-up" in out
    recovered = "recovered from the loss of ranks [1]" in out
    assert restarted or recovered, out[-5000:]
    assert_same_model(tmp_path / "final.pt", reference(2, 2, STEPS))


def test_a_start_up_error_is_a_lost_peer_only_when_a_death_of_that_start_up_is_reported(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker whose script raised during the start-up leaves as lost when a rank of its generation was lost
    before the start-up ended (a host's loss is reported after the node timeout: it waits that long), and
    reports its error otherwise."""
    from ds_recycle.resilience.world import peer_lost_in_start_up

    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    monkeypatch.setenv("DS_RECYCLE_LAUNCHER", "1")
    monkeypatch.setenv("DS_RECYCLE_STORE", f"127.0.0.1:{store.port}")
    monkeypatch.setenv(keys.GENERATION_ENV, "0")
    started = time.monotonic()
    assert not peer_lost_in_start_up(0.5)  # nothing reported: the script's own error
    assert time.monotonic() - started >= 0.5
    threading.Timer(0.3, lambda: store.add(keys.start_up_deaths_key(0), 1)).start()
    assert peer_lost_in_start_up(5.0)  # reported while it waits
    store.set(keys.started_key(0), "1")
    assert not peer_lost_in_start_up(5.0)  # the start-up was over: the failure handler's business
    monkeypatch.setenv(keys.GENERATION_ENV, "1")
    store.add(keys.GENERATION_KEY, 2)
    assert peer_lost_in_start_up(0.1)  # the job moved on to another generation: its start-up restarted
