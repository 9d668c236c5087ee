"""The harness's pure parts: the one-line ds_recycle variant of a script, and the final-file comparison."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ds_recycle.tools.procs import worker_pids
from tests.byom.harness import (
    RUN_TIMEOUT_S,
    SITE,
    USER_TRAIN,
    assert_same_final,
    identical,
    recycle_variant,
    script_args,
    start_ds_recycle,
    start_torchrun,
)


def test_variant_of_the_user_script_changes_exactly_the_documented_lines() -> None:
    before = USER_TRAIN.read_text().splitlines()
    after = recycle_variant(USER_TRAIN.read_text()).splitlines()
    assert len(after) == len(before) + 1
    at = before.index("import deepspeed")
    assert after[at:at + 2] == ["import deepspeed", "import ds_recycle"]
    changed = [(a, b) for a, b in zip(before, after[:at + 1] + after[at + 2:]) if a != b]
    assert len(changed) == 1 and "= deepspeed.initialize(" in changed[0][0]
    assert changed[0][1] == changed[0][0].replace("deepspeed.initialize(", "ds_recycle.initialize(")
    compile("\n".join(after), "variant", "exec")


def test_variant_keeps_indentation_and_ignores_lookalikes() -> None:
    source = ("def main():\n    import deepspeed\n    my_deepspeed.initialize(x)\n"
              "    e = deepspeed.initialize(model=m)\n")
    assert recycle_variant(source) == ("def main():\n    import deepspeed\n    import ds_recycle\n"
                                       "    my_deepspeed.initialize(x)\n    e = ds_recycle.initialize(model=m)\n")


@pytest.mark.parametrize("source", [
    "import deepspeed\nx = 1\n",  # no initialize call
    "x = deepspeed.initialize(model=m)\n",  # no import line
    "import deepspeed\na = deepspeed.initialize(m)\nb = deepspeed.initialize(n)\n",  # two calls
    "import deepspeed\nimport deepspeed\na = deepspeed.initialize(m)\n",  # two imports
])
def test_variant_refuses_scripts_it_cannot_change_by_the_documented_rule(source: str) -> None:
    with pytest.raises(AssertionError):
        recycle_variant(source)


def test_final_file_comparison(tmp_path: Path) -> None:
    a = {"0.weight": torch.ones(3, 2), "tied_modules.embed.weight": torch.arange(4.0)}
    near = {k: v * (1 + 1e-7) for k, v in a.items()}
    far = {**a, "0.weight": a["0.weight"] * (1 + 1e-4)}
    for name, state in {"a": a, "near": near, "far": far, "fewer": {"0.weight": a["0.weight"]}}.items():
        torch.save(state, tmp_path / f"{name}.pt")
    assert identical(tmp_path / "a.pt", tmp_path / "a.pt")
    assert not identical(tmp_path / "a.pt", tmp_path / "near.pt")
    assert_same_final(tmp_path / "near.pt", tmp_path / "a.pt")
    for other in ("far", "fewer"):
        with pytest.raises(AssertionError):
            assert_same_final(tmp_path / f"{other}.pt", tmp_path / "a.pt")


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_kill_rank_reaches_the_worker_under_ds_recycle_launch(tmp_path: Path) -> None:
    """The stock script under ``ds-recycle launch --strict``: the SIGKILLed rank is the one the launcher reports."""
    with start_ds_recycle(USER_TRAIN, script_args("mlp", steps=400), tmp_path, launcher_args=("--strict",)) as job:
        job.wait_for(r"step 2 loss", timeout=RUN_TIMEOUT_S)
        pid = job.kill_rank(3)
        run = job.result(RUN_TIMEOUT_S)
    assert run.returncode != 0 and run.final is None
    assert re.search(rf"rank 3 \(pid {pid}\).*(SIGKILL|signal 9)", run.log), run.log[-3000:]
    assert len(run.losses()) < 400


_PROBE = ("import sys, deepspeed, deepspeed.ops; t = sys.modules['deepspeed.comm.torch']; "
          "print('compatible', deepspeed.ops.__compatible_ops__['deepspeed_shm_comm']); "
          "print('wrapped', t.build_shm_op.__qualname__ != 'build_shm_op'); "
          "print('built', t.build_shm_op() is not None if 'site' in sys.argv else '-')")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("with_site", [False, True])
def test_site_hook_makes_deepspeed_skip_the_shm_op_build(with_site: bool) -> None:
    """Without the hook DeepSpeed would build the op (it is compatible here); with it, the build is skipped."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(SITE) if with_site else ""}
    args = [sys.executable, "-c", _PROBE] + (["site"] if with_site else [])
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=100).stdout.split()
    if with_site:
        assert out == ["compatible", "True", "wrapped", "True", "built", "False"], out
    else:
        assert out == ["compatible", "True", "wrapped", "False", "built", "-"], out


_LEAVER = """
import sys, threading, time
print(sys.exit.__module__, end=" ")
log = open(sys.argv[1], "w")
log.write("unclosed file ")  # never flushed nor closed by the script
def late() -> None:
    time.sleep(0.3)
    print("from a thread", end=" ")
threading.Thread(target=late).start()
print("unflushed", end=" ")
if sys.argv[2] == "exit":
    sys.exit(3)
if sys.argv[2] == "raise":
    raise RuntimeError("boom")
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("how", "status"), [("end", 0), ("exit", 3), ("raise", 1)])
@pytest.mark.parametrize("rank", [None, "0"])
def test_site_hook_leaves_a_stock_worker_without_teardown_and_loses_nothing(tmp_path: Path, how: str, status: int,
                                                                        rank: str | None) -> None:
    """Unflushed output, an unclosed file and a live thread's print survive, and the exit status is the
    interpreter's; the hook is on in a stock launcher's worker (``RANK`` set) only."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "DS_RECYCLE_LAUNCHER")}
    env = {**env, "PYTHONPATH": str(SITE), **({"RANK": rank} if rank else {})}
    out = subprocess.run([sys.executable, "-c", _LEAVER, str(tmp_path / "log"), how], env=env, capture_output=True,
                         text=True, timeout=50)
    assert out.returncode == status, out.stderr
    assert out.stdout == f"{'sitecustomize' if rank else 'sys'} unflushed from a thread ", out.stdout
    assert (tmp_path / "log").read_text() == "unclosed file "
    assert ("RuntimeError: boom" in out.stderr) == (how == "raise")


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for its new parent to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_timed_out_torchrun_job_leaves_no_worker_behind(tmp_path: Path) -> None:
    """torchrun starts its workers in sessions of their own: the harness must still kill every one of them."""
    with start_torchrun(USER_TRAIN, script_args("mlp", steps=10**6), tmp_path) as job:
        job.wait_for(r"step 1 loss", timeout=RUN_TIMEOUT_S)
        workers = worker_pids(job.proc.pid)
        assert sorted(workers) == [0, 1, 2, 3], workers
        with pytest.raises(AssertionError, match="timed out"):
            job.result(timeout=time.monotonic() - job.started + 1.0)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in workers.values() if _alive(pid)]
