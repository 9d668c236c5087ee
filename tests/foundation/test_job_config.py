"""A user's DeepSpeed config read for the drop-in ``ds_recycle.initialize`` (ds_recycle.config.job)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ds_recycle.config import ConfigError
from ds_recycle.config.job import job_config, read_deepspeed_config


def _cfg(**keys: Any) -> dict[str, Any]:
    return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **keys}


def test_stages_from_the_module_pipelines_from_the_world_and_defaults_without_a_section() -> None:
    cfg = job_config(_cfg(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4), stages=2, world_size=6)
    assert (cfg.recycle.stages, cfg.recycle.pipelines, cfg.micro_batches, cfg.micro_batch_size) == (2, 3, 4, 2)
    assert cfg.deepspeed["train_batch_size"] == 2 * 4 * 3 and "recycle" not in cfg.deepspeed
    assert cfg.recycle.schedule == "adaptive" and cfg.gradient_clipping == 1.0


@pytest.mark.parametrize("keys,want", [
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2}, (2, 6)),
    ({"train_batch_size": 24, "gradient_accumulation_steps": 3}, (4, 3)),
    ({"train_micro_batch_size_per_gpu": 5}, (5, 1)),
    ({"train_batch_size": 12}, (6, 1)),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, (4, 3)),
])
def test_any_two_batch_keys_as_deepspeed_resolves_them(keys: dict[str, int], want: tuple[int, int]) -> None:
    cfg = job_config(_cfg(**keys), stages=2, world_size=4)
    assert (cfg.micro_batch_size, cfg.micro_batches) == want
    assert cfg.deepspeed["train_batch_size"] == want[0] * want[1] * 2


def test_batch_keys_that_disagree_name_the_key_and_the_product() -> None:
    with pytest.raises(ConfigError, match=r"train_batch_size.*25.*= 24"):
        job_config(_cfg(train_batch_size=25, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=3),
                   stages=2, world_size=4)
    with pytest.raises(ConfigError, match="set two of"):
        job_config(_cfg(gradient_accumulation_steps=3), stages=2, world_size=4)


@pytest.mark.parametrize("keys,match", [
    ({"zero_optimization": {"stage": 1}}, "shards the optimizer state"),
    ({"fp16": {"enabled": True}}, "loss scaling is not supported"),
    ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}}, "data_types.grad_accum_dtype"),
    ({"bf16": {"enabled": True}, "communication_data_type": "bf16"}, "communication_data_type"),
    ({"recycle": {"stages": 3}}, r"recycle.stages.*num_stages is 2"),
    ({"recycle": {"pipelines": 4}}, r"recycle.pipelines.*is 2"),
    ({"recycle": {"assume_failed": [[0, 1]]}}, "needs every worker at start"),
    ({"recycle": {"schedul": "1f1b"}}, "did you mean 'schedule'"),
    ({"gradient_clipping": -1}, "gradient_clipping"),
])
def test_what_the_engine_cannot_run_is_refused_with_the_fix(keys: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as err:
        job_config(_cfg(train_micro_batch_size_per_gpu=2, **keys), stages=2, world_size=4)
    assert "Fix:" in str(err.value)


def test_world_not_a_multiple_of_the_stages() -> None:
    with pytest.raises(ConfigError, match="not a multiple"):
        job_config(_cfg(train_micro_batch_size_per_gpu=2), stages=2, world_size=5)


def test_adam_block_is_built_as_torch_adam_with_fused_adams_weight_decay_on_cpu() -> None:
    cfg = job_config(_cfg(train_micro_batch_size_per_gpu=2), stages=2, world_size=4)
    assert cfg.deepspeed["optimizer"]["params"] == {"lr": 1e-3, "torch_adam": True, "weight_decay": 0.0}
    kept = job_config({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {
        "lr": 1e-3, "torch_adam": True}}}, stages=2, world_size=4)
    assert kept.deepspeed["optimizer"]["params"] == {"lr": 1e-3, "torch_adam": True}  # the user's choice stays
    sgd = job_config({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
                     stages=2, world_size=4)
    assert sgd.deepspeed["optimizer"]["params"] == {"lr": 0.1}


def test_absent_workers_only_with_a_module_built_on_a_grid_with_those_holes() -> None:
    cfg = job_config(_cfg(train_micro_batch_size_per_gpu=2, recycle={"assume_failed": [[1, 0]]}), stages=2,
                     world_size=4, absent=frozenset({(1, 0)}))
    assert cfg.recycle.assume_failed == ((1, 0),)
    with pytest.raises(ConfigError, match="lacks"):
        job_config(_cfg(train_micro_batch_size_per_gpu=2, recycle={"assume_failed": [[0, 1]]}), stages=2,
                   world_size=4, absent=frozenset({(1, 0)}))


def test_config_from_a_dict_a_path_or_args(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8}))
    assert read_deepspeed_config({"a": 1}) == {"a": 1}
    assert read_deepspeed_config(str(path)) == {"train_batch_size": 8}
    assert read_deepspeed_config(None, SimpleNamespace(deepspeed_config=str(path))) == {"train_batch_size": 8}
    assert read_deepspeed_config(None, config_params={"b": 2}) == {"b": 2}
    with pytest.raises(ConfigError, match="no DeepSpeed config"):
        read_deepspeed_config(None, SimpleNamespace())
    with pytest.raises(ConfigError, match="no file"):
        read_deepspeed_config(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_deepspeed_config(str(tmp_path / "bad.json"))


def test_bf16_runs_with_fp32_accumulation_hidden_from_deepspeed() -> None:
    cfg = job_config(_cfg(train_micro_batch_size_per_gpu=2, bf16={"enabled": True},
                          data_types={"grad_accum_dtype": "fp32"}), stages=2, world_size=4)
    assert cfg.deepspeed["bf16"] == {"enabled": True}
    assert "data_types" not in cfg.deepspeed  # DeepSpeed refuses bf16 weights with fp32 accumulation at stage 0
