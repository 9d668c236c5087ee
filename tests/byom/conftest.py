"""Vanilla DeepSpeed runs of the user script, made once per session and shared by the tests that need them."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.byom.harness import RUN_TIMEOUT_S, USER_TRAIN, Run, VanillaRuns, run_deepspeed, run_torchrun, script_args


@pytest.fixture(scope="session")
def vanilla(tmp_path_factory: pytest.TempPathFactory) -> VanillaRuns:
    """``vanilla(model, launcher="torchrun", config="fp32", repeat=0)``: a checked stock run, made on first use."""
    made: dict[tuple[str, str, str, int], Run] = {}

    def get(model: str, launcher: str = "torchrun", config: str = "fp32", repeat: int = 0) -> Run:
        key = (model, launcher, config, repeat)
        if key not in made:
            workdir: Path = tmp_path_factory.mktemp(f"vanilla-{model}-{launcher}-{config}-{repeat}")
            run = {"torchrun": run_torchrun, "deepspeed": run_deepspeed}[launcher]
            made[key] = run(USER_TRAIN, script_args(model, config), workdir, RUN_TIMEOUT_S).check()
        return made[key]

    return get
