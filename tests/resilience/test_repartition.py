"""Layers moved between stages of a running job, from live holders: the model stays the failure-free one.

A 3 x 2 tiny GPT (embedding, 3 blocks, head: five layers, cut [0, 2, 3, 5]) with worker (1, 1) absent trains 7
iterations under ``ds-recycle launch``; before iteration 2 the layers move to [0, 1, 3, 5] (block 1 leaves stage 0,
so the first-stage clipping norm is gathered from two stages), before 4 to [0, 2, 4, 5], before 6 back to the job's
own cut. Its final parameters equal the failure-free reference bit for bit.
"""
from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tests.harness import assert_same_model, run, tiny_config  # noqa: E402

STEPS = 7
pytestmark = [pytest.mark.multiprocess]


@pytest.mark.timeout(400)
def test_layers_move_there_and_back_same_model(tmp_path: Path, reference: Callable[[int, int, int], Path]) -> None:
    config = tiny_config(tmp_path, "moving", 3, 2, assume_failed=[[1, 1]], fail_slow={"enabled": False})
    out = tmp_path / "final.pt"
    job = run([sys.executable, "-m", "ds_recycle", "launch", "--num_accelerators", "5", "--master_port", "0",
               str(REPO / "tests" / "engine" / "_repartition_job.py"), "--deepspeed_config", str(config),
               "--steps", str(STEPS), "--move", "2=0,1,3,5", "--move", "4=0,2,4,5", "--move", "6=0,2,3,5",
               "--save-final", str(out)], timeout=300)
    assert job.returncode == 0, job.output[-4000:]
    moved = re.findall(r"MOVED (\d) (\[.*?\]) holds (\[.*?\])", job.output)
    assert len(moved) == 3 * 5, job.output[-3000:]  # every live worker, each move
    assert {(k, holds) for k, _, holds in moved} == {("2", "[0, 1, 3, 5]"), ("4", "[0, 2, 4, 5]"),
                                                     ("6", "[0, 2, 3, 5]")}
    # iteration 2: block 1 goes to the two live workers of stage 1 (ranks 2 and 3 hold stage 1: rank 2 is (0, 1);
    # worker (1, 1) is absent, so stage 1 has one live worker, rank 2), from stage 0 of its own pipeline (rank 0)
    first = {lists for k, lists, _ in moved if k == "2"}
    assert first == {"[(1, 0, 2)]"}, first
    clipped = [int(c) for c in re.findall(r"CLIPPED (\d+)", job.output)]
    assert clipped and max(clipped) >= 1, "clipping was not exercised"
    assert_same_model(out, reference(3, 2, STEPS))
