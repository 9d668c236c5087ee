"""Who sends which layer in a re-partition, and which models refuse to move (the move itself runs in
tests/resilience/test_repartition.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from deepspeed.pipe import LayerSpec, TiedLayerSpec

from ds_recycle.engine.layer_move import Transfer, movable_reason, pinned_layers, receive_layers, transfers
from ds_recycle.plan.partition import layer_moves
from ds_recycle.runtime.grid import WorkerMap


def test_each_receiver_gets_the_layer_from_a_live_holder() -> None:
    # 3 x 2, worker (1, 2) absent: ranks (0,0)=0 (1,0)=1 (0,1)=2 (1,1)=3 (0,2)=4
    workers = WorkerMap.dense(3, 2, frozenset({(1, 2)}))
    moves = layer_moves((0, 2, 4, 6), (0, 3, 5, 6))  # layer 2: stage 1 -> 0; layer 4: stage 2 -> 1
    assert [(m.layer, m.source, m.target) for m in moves] == [(2, 1, 0), (4, 2, 1)]
    assert transfers(moves, workers) == [
        Transfer(2, 2, 0), Transfer(2, 3, 1),  # each pipeline's own holder
        Transfer(4, 4, 2), Transfer(4, 4, 3),  # pipeline 1's holder is absent: the first live one sends
    ]


def test_what_cannot_move_is_named() -> None:
    linear = LayerSpec(torch.nn.Linear, 2, 2)
    ok = SimpleNamespace(_layer_specs=[linear, torch.relu, linear], activation_checkpoint_interval=0)
    assert movable_reason(ok) is None
    tied = SimpleNamespace(_layer_specs=[TiedLayerSpec("emb", torch.nn.Linear, 2, 2), linear],
                           activation_checkpoint_interval=0)
    assert movable_reason(tied) is None  # the other layers move around it
    built = SimpleNamespace(_layer_specs=[linear, torch.nn.Linear(2, 2)], activation_checkpoint_interval=0)
    assert "Fix: give LayerSpec(Linear, ...)" in (movable_reason(built) or "")
    checkpointed = SimpleNamespace(_layer_specs=[linear], activation_checkpoint_interval=1)
    assert movable_reason(checkpointed) is None  # segments are recut after a move
    assert "not a DeepSpeed PipelineModule" in (movable_reason(torch.nn.Linear(1, 1)) or "")


def test_tied_layers_are_pinned_and_a_partition_moving_one_is_refused_before_anything_moves() -> None:
    linear = LayerSpec(torch.nn.Linear, 2, 2)
    specs = [TiedLayerSpec("emb", torch.nn.Linear, 2, 2), linear, TiedLayerSpec("mid", torch.nn.Linear, 2, 2),
             linear, TiedLayerSpec("emb", torch.nn.Linear, 2, 2)]
    module = SimpleNamespace(_layer_specs=specs, parts=[0, 3, 5], activation_checkpoint_interval=0)
    assert pinned_layers(module, (0, 3, 5)) == {0: 0, 2: 0, 4: 1}
    with pytest.raises(ValueError, match=r"moves tied layer\(s\) \[2\]"):  # raised before any transfer
        receive_layers(module, None, (0, 2, 5), WorkerMap.dense(2, 1, frozenset()), 0, None)  # type: ignore[arg-type]
