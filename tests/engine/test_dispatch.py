"""DeepSpeed's exact-type dispatch really reaches ds_recycle's handlers (a real one-process engine)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ds_recycle.engine import instructions as ins
from ds_recycle.engine.engine import RecyclePipelineEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spawn import spawn  # noqa: E402


def test_every_instruction_is_registered_with_its_own_handler() -> None:
    table = RecyclePipelineEngine._INSTRUCTION_MAP
    for cls in ins.RECYCLE_INSTRUCTIONS:
        assert cls in table, f"{cls.__name__} is not in the dispatch table"
        assert table[cls].__qualname__.startswith("InstructionHandlers._exec_"), table[cls]
    assert len({table[c] for c in ins.RECYCLE_INSTRUCTIONS}) == len(ins.RECYCLE_INSTRUCTIONS)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_engine_runs_its_handlers_and_names_unknown_instructions() -> None:
    out = spawn(1, ["tests/engine/_dispatch_job.py"], timeout=100)[0]
    report = json.loads(next(line for line in out.splitlines() if line.startswith("REPORT "))[7:])
    assert set(report["executed"]) >= {"LoadMicroBatchOf", "ForwardMicroBatch", "BackwardInput", "BackwardWeight",
                                       "StaggeredOptimizerStep", "FinishOptimizerStep", "WaitSends"}
    assert report["spy"] == ["W(0, 0)", "W(0, 1)"]  # the subclass's override ran, once per micro-batch
    assert "has no handler for instruction Unknown()" in report["unknown_error"]
    assert 4.0 < report["loss"] < 7.0  # a real cross-entropy over 256 byte values at initialisation
    assert report["steps"] == 2 and report["whole_model_norm"] > 0.0  # the WHOLE_MODEL clipping norm ran
