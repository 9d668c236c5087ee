"""Final parameters of ds_recycle == vanilla DeepSpeed (Adam, 20 iterations, clipping on, rtol 1e-5).

Each test launches real jobs with ``ds-recycle launch`` (gloo, one thread per process), then compares the
``--save-final`` files with ``ds-recycle compare``. Runs are sequential; the whole file takes ~3 minutes on
2 cores.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tests.harness import assert_same_model, launch, tiny_config  # noqa: E402

STEPS = "20"
pytestmark = [pytest.mark.multiprocess]


def _config(tmp: Path, name: str, stages: int, schedule: str = "1f1b", absent: list | None = None,
            enabled: bool = True, costs_file: str | None = None, optimizer_step: str = "staggered") -> Path:
    return tiny_config(tmp, name, stages, enabled=enabled, schedule=schedule, optimizer_step=optimizer_step,
                       assume_failed=absent or None, costs_file=costs_file)


def _train(tmp: Path, config: Path, nproc: int, vanilla: bool = False) -> tuple[Path, str]:
    out = tmp / f"{config.stem}.pt"
    args = ["--deepspeed_config", str(config), "--steps", STEPS, "--save-final", str(out)]
    job = launch(nproc, args + (["--vanilla"] if vanilla else []), timeout=150)
    assert job.returncode == 0, job.output[-4000:]
    return out, job.output


def _steps_and_clipped(output: str) -> tuple[set[int], int]:
    found = [tuple(map(int, m)) for m in re.findall(r"optimizer steps: (\d+), clipped (\d+)", output)]
    assert found, "the engine did not report its optimizer steps"
    return {s for s, _ in found}, max(c for _, c in found)


@pytest.fixture(scope="module")
def vanilla_2x2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Vanilla DeepSpeed's final model of the 2 x 2 job (shared by the tests that compare against it)."""
    tmp = tmp_path_factory.mktemp("vanilla2x2")
    return _train(tmp, _config(tmp, "vanilla", 2, enabled=False), 4, vanilla=True)[0]


@pytest.mark.timeout(420)
def test_2x2_vanilla_equals_1f1b_and_zero_bubble_plans(tmp_path: Path, vanilla_2x2: Path) -> None:
    vanilla = vanilla_2x2
    for schedule, step in (("1f1b", "synchronous"), ("zb-h1", "staggered")):
        mine, output = _train(tmp_path, _config(tmp_path, schedule, 2, schedule, optimizer_step=step), 4)
        assert_same_model(mine, vanilla)
        steps, clipped = _steps_and_clipped(output)
        assert clipped >= 1, "clipping was not exercised"
        assert steps == {int(STEPS)}, "every worker steps each iteration exactly once"


@pytest.mark.timeout(540)
def test_2x2_absent_workers_equal_vanilla(tmp_path: Path, vanilla_2x2: Path) -> None:
    """One absent in the first stage, one in the last stage, and two in different stages."""
    vanilla = vanilla_2x2
    for name, absent in (("first", [[1, 0]]), ("last", [[0, 1]]), ("two", [[1, 0], [0, 1]])):
        mine, output = _train(tmp_path, _config(tmp_path, name, 2, "adaptive", absent), 4 - len(absent))
        assert_same_model(mine, vanilla)
        assert re.search(r"rerouted [1-9]", output), "no micro-batch was re-routed"


@pytest.mark.timeout(420)
def test_3_stages_absent_middle_equals_vanilla(tmp_path: Path) -> None:
    vanilla, _ = _train(tmp_path, _config(tmp_path, "vanilla3", 3, enabled=False), 6, vanilla=True)
    mine, _ = _train(tmp_path, _config(tmp_path, "middle", 3, "zb-h1", [[1, 1]]), 5)
    assert_same_model(mine, vanilla)


@pytest.mark.timeout(120)
def test_plan_that_cannot_run_fails_fast_with_a_clear_error(tmp_path: Path) -> None:
    costs = tmp_path / "costs3.json"
    costs.write_text(json.dumps({"F": [1, 1, 1], "B": [1, 1, 1], "W": [1, 1, 1], "O": [0, 0, 0], "comm": 0}))
    config = _config(tmp_path, "bad", 2, "adaptive", [[1, 0]], costs_file=str(costs))
    job = launch(3, ["--deepspeed_config", str(config), "--steps", "2"], timeout=90)
    assert job.returncode != 0
    assert "no runnable plan" in job.output and "costs3.json" in job.output, job.output[-3000:]
