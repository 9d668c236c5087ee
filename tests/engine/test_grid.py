"""SurvivorGrid's pipe and data groups mean what DeepSpeed's PipelineParallelGrid's mean (4 gloo processes)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spawn import spawn  # noqa: E402


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_pipe_group_is_one_pipelines_stages_as_in_deepspeed() -> None:
    outs = spawn(4, ["tests/engine/_grid_job.py"], timeout=160)
    for rank, out in enumerate(outs):
        report = json.loads(next(line for line in out.splitlines() if line.startswith("REPORT "))[7:])
        ours, our_ranks, theirs, their_ranks = report["pipe"]
        assert ours == our_ranks == theirs == their_ranks == [rank % 2, rank % 2 + 2], (rank, report)
        assert report["data"][0] == report["data"][1], (rank, report)
        assert report["pipe_sum"] == 2.0  # the group works: the pipeline's two stages
