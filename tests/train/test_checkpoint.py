"""Periodic checkpoints carry the data position: stop, resume, and end at the uninterrupted model."""
from __future__ import annotations

from pathlib import Path

import pytest

from ds_recycle.tools.compare import compare_state_dicts
from tests.harness import REPO, launch

CONFIG = str(REPO / "configs" / "gpt_cpu_2x1.json")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_resume_from_checkpoint_reaches_the_uninterrupted_model(tmp_path: Path) -> None:
    import torch

    common = ["--deepspeed_config", CONFIG, "--vanilla"]
    full = launch(2, [*common, "--steps", "6", "--save-final", str(tmp_path / "full.pt")])
    assert full.returncode == 0, full.output[-3000:]
    ckpt = tmp_path / "ckpt"
    first = launch(2, [*common, "--steps", "3", "--checkpoint-dir", str(ckpt), "--checkpoint-interval", "2"])
    assert first.returncode == 0, first.output[-3000:]
    assert (ckpt / "latest").read_text().strip() == "iter2"
    resumed = launch(2, [*common, "--steps", "6", "--checkpoint-dir", str(ckpt), "--resume",
                         "--save-final", str(tmp_path / "resumed.pt")])
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "resumed from" in resumed.output and "at iteration 2" in resumed.output
    diffs = compare_state_dicts(torch.load(tmp_path / "resumed.pt"), torch.load(tmp_path / "full.pt"), rtol=1e-6)
    assert diffs and all(d.ok for d in diffs), [d for d in diffs if not d.ok][:3]
