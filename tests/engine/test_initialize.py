"""``ds_recycle.initialize`` refuses at start, with the reason and the fix, what the engine cannot run."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spawn import spawn  # noqa: E402


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_unsupported_inputs_are_refused_at_initialize() -> None:
    out = spawn(1, ["tests/engine/_refusals_job.py"], timeout=160)[0]
    report = json.loads(next(line for line in out.splitlines() if line.startswith("REPORT "))[7:])
    assert "not a deepspeed.pipe.PipelineModule" in report["not_pipeline"]
    assert "default activation_checkpoint_func" in report["checkpointing"]
    assert "loss scaling is not supported" in report["fp16"] and "Fix:" in report["fp16"]
    assert report["bf16"] == "MasterWeightOptimizer torch.bfloat16 torch.float32"  # fp32 masters, bf16 weights
    assert "zero_optimization.stage" in report["zero"] and "shards the optimizer state" in report["zero"]
    assert "no optimizer given" in report["no_optimizer"]
    assert "training_data" in report["not_a_dataset"] and "micro_batch" in report["not_a_dataset"]
    assert report["accepted"] == "RecyclePipelineEngine SGD None None"
    assert "re-routing" in report["plain_iterator"] or "addressable" in report["plain_iterator"], report
    assert report["config_is_users"] is True, "engine.config is the user's own dict, as DeepSpeed's"
    assert report["applied_before"] is False and report["applied_after"] is True
    assert report["batch_fn_loss"] > 1000.0 and report["batch_fn_calls"] == [2, 2], "set_batch_fn runs per micro-batch"
    assert isinstance(report["norm"], float) and report["norm"] >= 0.0
    assert report["dataloader_loss"] > 0.0 and report["dataiterator_loss"] > 0.0
    assert "1 keep running statistics" in out, "BatchNorm buffers: said at initialize"


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_second_engine_in_one_launched_worker_says_why_at_once() -> None:
    from tests.harness import REPO, run

    job = run([sys.executable, "-m", "ds_recycle", "launch", "--num_accelerators", "1", "--master_port", "0",
               "--no_local_rank", str(REPO / "tests" / "engine" / "_two_engines_job.py")], timeout=100)
    assert "SECOND a second ds_recycle.initialize in one process" in job.output, job.output[-3000:]
    assert "Reuse the first engine" in job.output
