"""The repartitioner's pieces without processes: per-layer costs, the decision document, what a move must save."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from deepspeed.pipe import LayerSpec

from ds_recycle.config.schema import ConfigError, RepartitionConfig
from ds_recycle.engine.position import Position
from ds_recycle.plan import CostModel, PlanError
from ds_recycle.resilience.repartition import Decision, Repartitioner, layer_costs_of, settle_move

SPECS = [LayerSpec(torch.nn.Embedding, 10, 4), LayerSpec(torch.nn.Linear, 4, 4), torch.relu,
         LayerSpec(torch.nn.Linear, 4, 4), LayerSpec(torch.nn.Linear, 4, 10)]


def test_stage_costs_are_split_over_the_layers_that_hold_parameters() -> None:
    costs = CostModel((2.0, 3.0), (2.0, 3.0), (1.0, 1.5), (0.0, 0.0))
    layers = layer_costs_of(SPECS, (0, 3, 5), costs, RepartitionConfig())
    assert layers.F == (1.0, 1.0, 0.0, 1.5, 1.5)  # the function (relu) takes none of stage 0's share
    assert layers.stage_costs((0, 3, 5)).F == costs.F
    assert layers.state_bytes == (16 * 40, 16 * 20, 0.0, 16 * 20, 16 * 50)


def test_a_layer_costs_file_is_read_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "layers.json"
    path.write_text(json.dumps({"F": [0, 1, 0, 1, 2], "B": [0, 1, 0, 1, 2], "W": [0, 1, 0, 1, 2]}))
    cfg = RepartitionConfig(layer_costs_file=str(path))
    assert layer_costs_of(SPECS, (0, 3, 5), CostModel.uniform(2), cfg).W == (0, 1, 0, 1, 2)
    path.write_text(json.dumps({"F": [1, 1], "B": [1, 1], "W": [1, 1]}))
    with pytest.raises(PlanError, match="5 layers in the model.*Fix: one value per layer"):
        layer_costs_of(SPECS, (0, 3, 5), CostModel.uniform(2), cfg)
    with pytest.raises(PlanError, match="Fix: a JSON object with F, B, W"):
        layer_costs_of(SPECS, (0, 3, 5), CostModel.uniform(2), RepartitionConfig(layer_costs_file=str(tmp_path / "x")))


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match="recycle.repartition.after_iterations"):
        RepartitionConfig(after_iterations=0)
    with pytest.raises(ConfigError, match="recycle.repartition.bandwidth_gbs"):
        RepartitionConfig(bandwidth_gbs=0.0)


def test_a_move_must_save_more_than_its_transfer() -> None:
    layers = layer_costs_of(SPECS, (0, 3, 5), CostModel.uniform(2), RepartitionConfig())
    rep = Repartitioner(RepartitionConfig(horizon=10, bandwidth_gbs=1e-6), layers, (0, 3, 5), 4, {}, None, "r",
                        lambda: None)
    rep._stamps = [0.0, 1.0, 2.0, 3.0]  # 1 s an iteration measured
    move = Decision((0, 4, 5), {"plan": "document"}, 10.0, 8.0, "planned")
    pays, why = rep._pays(move, (0, 3, 5))  # saves 10 x 1 s x 0.2 = 2 s; moves 320 bytes at 1 kB/s: 0.32 s
    assert pays and "saves 2.00 s" in why and "takes 0.32 s" in why
    rep.cfg = RepartitionConfig(horizon=1, bandwidth_gbs=1e-6)
    assert not rep._pays(move, (0, 3, 5))[0]  # 0.2 s saved
    assert not rep._pays(move, (0, 4, 5))[0]  # already there
    again = Decision.from_json(move.to_json())
    assert again == move


def _at(partition: tuple[int, ...], pending: tuple[int, ...] = ()) -> Position:
    return Position(0, 4, 5, (), (), (), False, partition, pending)


def test_a_move_a_failure_interrupted_is_completed_if_anyone_installed_it_else_dropped() -> None:
    old, new = (0, 2, 4), (0, 1, 4)
    # a peer lost inside the move's barrier: rank 0 passed it and installed, ranks 2 and 3 did not
    split = {0: _at(new), 2: _at(old, new), 3: _at(old, new)}
    assert [settle_move(split, r) for r in (0, 2, 3)] == [None, "complete", "complete"]
    # lost before anyone passed the barrier: everyone drops what it received
    before = {0: _at(old, new), 2: _at(old, new), 3: _at(old)}
    assert [settle_move(before, r) for r in (0, 2, 3)] == ["drop", "drop", None]
    assert settle_move({0: _at(new), 2: _at(new)}, 0) is None  # lost after everyone installed
    with pytest.raises(RuntimeError, match="different layer partitions"):
        settle_move({0: _at(new), 2: _at(old)}, 0)


def test_a_position_carries_its_partition_and_pending_move() -> None:
    p = _at((0, 2, 4), (0, 1, 4))
    assert Position.from_json(p.to_json()) == p
