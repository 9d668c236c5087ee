"""The strict config parser rejects each kind of bad input with the key, the value and the fix."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ds_recycle.config import ConfigError, load_config


def base(**recycle: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
            "recycle": {"stages": 2, "pipelines": 2, **recycle}}


def test_valid_config_resolves_defaults() -> None:
    cfg = load_config(base())
    assert cfg.deepspeed["train_batch_size"] == 2 * 4 * 2
    assert cfg.gradient_clipping == 1.0  # DeepSpeed's default, made explicit
    assert cfg.recycle.world_size == 4
    assert cfg.optimizer_type == "AdamW"
    assert "recycle" not in cfg.deepspeed and "optimizer" not in cfg.deepspeed


@pytest.mark.parametrize("mutate, key, words", [
    (lambda c: c["recycle"].update(stagse=2), "recycle.stagse", "did you mean 'stages'"),
    (lambda c: c["recycle"].update(model={"n_layre": 2}), "recycle.model.n_layre", "n_layer"),
    (lambda c: c["recycle"].update(stages="2"), "recycle.stages", "expected int"),
    (lambda c: c["recycle"].update(enabled=1), "recycle.enabled", "expected bool"),
    (lambda c: c["recycle"].update(schedule="gpipe"), "recycle.schedule", "one of"),
    (lambda c: c["recycle"].update(stages=0), "recycle.stages", "at least 1"),
    (lambda c: c["recycle"].update(model={"d_model": 100, "n_head": 3}), "recycle.model.n_head", "divisors of 100"),
    (lambda c: c["recycle"].update(stages=8), "recycle.model.n_layer", "cannot fill 8 stages"),
    (lambda c: c["recycle"].update(assume_failed=[[0, 5]]), "recycle.assume_failed[0]", "outside"),
    (lambda c: c["recycle"].update(assume_failed=[[0, 1], [1, 1]]), "recycle.assume_failed", "every worker of stage 1"),
    (lambda c: c["recycle"].update(assume_failed=[[0, 1], [0, 1]]), "recycle.assume_failed[1]", "listed twice"),
    (lambda c: c["recycle"].update(memory_limit=0), "recycle.memory_limit", "below 1"),
    (lambda c: c["recycle"].update(transport="mpi"), "recycle.transport", "one of"),
    (lambda c: c.update(train_batch_size=10), "train_batch_size", "set train_batch_size to 16"),
    (lambda c: c.update(gradient_accumulation_steps=0), "gradient_accumulation_steps", "positive integer"),
    (lambda c: c.pop("train_micro_batch_size_per_gpu"), "train_micro_batch_size_per_gpu", "positive integer"),
    (lambda c: c.update(zero_optimization={"stage": 1}), "zero_optimization.stage", "use stage 0"),
    (lambda c: c.update(bf16={"enabled": True}), "bf16.enabled", "fp32"),
    (lambda c: c.update(optimizer={"type": "Lamb", "params": {"lr": 1}}), "optimizer.type", "Adam"),
    (lambda c: c.update(optimizer={"type": "Adam", "params": {}}), "optimizer.params.lr", "learning rate"),
    (lambda c: c.update(gradient_clipping=-1), "gradient_clipping", "non-negative"),
])
def test_bad_input_names_key_and_fix(mutate: Any, key: str, words: str) -> None:
    raw = base()
    mutate(raw)
    with pytest.raises(ConfigError) as err:
        load_config(raw)
    assert err.value.key == key
    assert words in str(err.value)
    assert "Fix:" in str(err.value)


def test_world_size_must_match_topology() -> None:
    cfg = load_config(base(assume_failed=[[1, 0]]))
    cfg.check_world_size(3)
    with pytest.raises(ConfigError, match="need 3 processes, but 4 were started.*--num_accelerators 3"):
        cfg.check_world_size(4)


def test_file_errors_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no file at"):
        load_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(bad)


def test_shipped_configs_load(repo: Path) -> None:
    paths = sorted((repo / "configs").glob("*.json"))
    assert paths, "configs/ holds no JSON config"
    for path in paths:
        cfg = load_config(path)
        assert json.loads(json.dumps(cfg.resolved()))  # the resolved config is plain JSON


def test_misspelt_top_level_section_is_refused_with_a_suggestion() -> None:
    cfg = base(model={"d_model": 256})
    cfg["recyle"] = cfg.pop("recycle")  # DeepSpeed would ignore it and the run would use our defaults
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    assert err.value.key == "recyle" and "did you mean 'recycle'?" in str(err.value)
    cfg = base()
    cfg["gradient_cliping"] = 0.5
    with pytest.raises(ConfigError, match="did you mean 'gradient_clipping'"):
        load_config(cfg)


def test_deepspeed_top_level_keys_are_accepted() -> None:
    cfg = base()
    cfg.update({"wandb": {"enabled": False}, "wall_clock_breakdown": False, "activation_checkpointing": {}})
    assert load_config(cfg).deepspeed["wall_clock_breakdown"] is False
