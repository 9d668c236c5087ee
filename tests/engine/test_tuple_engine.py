"""The ReCycle engine with tuple boundaries ``(hidden, bool mask, int64 positions)`` ends at vanilla's model."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds_recycle.tools.compare import compare_state_dicts
from tests.engine.spawn import REPO, spawn

JOB = str(REPO / "tests" / "engine" / "_tuple_engine_job.py")


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_tuple_boundaries_match_vanilla_with_fused_and_split_backward(tmp_path: Path) -> None:
    finals = {}
    for mode in ("vanilla", "1f1b", "zb-h1"):
        finals[mode] = tmp_path / f"{mode}.pt"
        spawn(4, [JOB, mode, str(finals[mode])], timeout=120)
    vanilla = torch.load(finals["vanilla"], weights_only=True)
    initial = torch.load(f"{finals['vanilla']}.init", weights_only=True)
    assert len(vanilla) == 1 + 4 * 3 + 2, sorted(vanilla)  # embedding, 4 x (linear + positions), head
    assert all(not torch.equal(vanilla[k], initial[k]) for k in vanilla), "some parameter did not train"
    for mode in ("1f1b", "zb-h1"):
        diffs = compare_state_dicts(torch.load(finals[mode], weights_only=True), vanilla, rtol=1e-5)
        assert all(d.ok for d in diffs), [d for d in diffs if not d.ok]
