"""The README's first command, end to end: ``bash launch/demo.sh``, shortened, through the same scripts.

A change to the events, the metrics, the launchers or the demo's own code that breaks the demo fails here.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SITE = REPO / "tests" / "site"


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_the_demo_trains_both_systems_prints_its_table_and_draws_the_plot(tmp_path: Path) -> None:
    # the tests' site hook: vanilla DeepSpeed's workers leave without module teardown (what they compute is unchanged)
    env = {**os.environ, "PYTHONPATH": str(SITE), "STEPS": "8", "KILL": "1:0@3:backward-input", "RESTART": "1", "OUT": str(tmp_path),
           "WANDB_MODE": "disabled"}
    done = subprocess.run(["bash", str(REPO / "launch" / "demo.sh")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=560)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "FAILURE: lost worker(s) [[1, 0]]" in out, out[-4000:]  # the survivors' events, as they happen
    assert "in-flight iteration 3 repaired" in out or "in-flight iteration 3 redone" in out, out[-4000:]
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("system") and "to final model s" in line)
    assert lines[header + 1].startswith("ds_recycle") and lines[header + 2].startswith("vanilla DeepSpeed")
    assert int(lines[header + 1].split()[2]) == 0  # ds_recycle rolls nothing back
    assert "final parameters, ds_recycle vs vanilla: MATCH" in out, out[-4000:]
    assert (tmp_path / "throughput.png").stat().st_size > 10_000
