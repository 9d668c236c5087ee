"""Failure-free reference models shared by the failure tests: each (shape, steps) is trained once per test run."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.harness import launch, tiny_config


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int, int, int], Path]:
    """``reference(stages, pipelines, steps)``: the final parameters of the tiny GPT (:func:`tests.harness.tiny_config`)
    trained failure-free under ``ds-recycle launch``, made on first use and shared by every test that asks."""
    made: dict[tuple[int, int, int], Path] = {}

    def get(stages: int, pipelines: int, steps: int) -> Path:
        key = (stages, pipelines, steps)
        if key not in made:
            tmp = tmp_path_factory.mktemp(f"reference-{stages}x{pipelines}-{steps}")
            out = tmp / "final.pt"
            job = launch(stages * pipelines, ["--deepspeed_config", str(tiny_config(tmp, "c", stages, pipelines)),
                                              "--steps", str(steps), "--save-final", str(out)], timeout=300)
            assert job.returncode == 0, job.output[-4000:]
            made[key] = out
        return made[key]

    return get
