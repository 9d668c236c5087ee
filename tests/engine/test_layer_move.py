"""Who sends which layer in a re-partition, and which models refuse to move (the move itself runs in
tests/resilience/test_repartition.py)."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from deepspeed.pipe import LayerSpec, TiedLayerSpec

from ds_recycle.engine.layer_move import Transfer, movable_reason, transfers
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
    assert "bf16" in (movable_reason(ok, bf16=True) or "")
    tied = SimpleNamespace(_layer_specs=[TiedLayerSpec("emb", torch.nn.Linear, 2, 2), linear],
                           activation_checkpoint_interval=0)
    assert "layer 0 is a TiedLayerSpec ('emb')" in (movable_reason(tied) or "")
    built = SimpleNamespace(_layer_specs=[linear, torch.nn.Linear(2, 2)], activation_checkpoint_interval=0)
    assert "Fix: give LayerSpec(Linear, ...)" in (movable_reason(built) or "")
    checkpointed = SimpleNamespace(_layer_specs=[linear], activation_checkpoint_interval=1)
    assert "activation checkpointing" in (movable_reason(checkpointed) or "")
    assert "not a DeepSpeed PipelineModule" in (movable_reason(torch.nn.Linear(1, 1)) or "")
