"""What ``ds_recycle.initialize`` and the engine check about a model, in one process: topologies, running
statistics, what may cross a stage boundary."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology
from torch import nn

from ds_recycle.api import UnsupportedModelError, _check_topology, running_statistics
from ds_recycle.engine.p2p import check_payload


def test_tensor_parallel_topology_is_refused_and_pipe_data_is_not() -> None:
    with pytest.raises(UnsupportedModelError, match=r"\{'model': 2\} beside pipe and data.*PipeDataParallelTopology"):
        _check_topology(SimpleNamespace(_topo=PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)))
    _check_topology(SimpleNamespace(_topo=PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=2)))
    _check_topology(SimpleNamespace(_topo=PipeDataParallelTopology(num_pp=2, num_dp=2)))


def test_running_statistics_are_named() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.LayerNorm(2), nn.BatchNorm1d(2, track_running_stats=False))
    assert running_statistics(model) == ["1"]


@dataclass
class _Out:
    hidden: torch.Tensor


@pytest.mark.parametrize(("payload", "named"), [
    ({"hidden": torch.zeros(1)}, "is a dict"),
    (_Out(torch.zeros(1)), "is a _Out"),
    ((torch.zeros(1), (torch.zeros(1),)), "tuple of ['Tensor', 'tuple']"),
    ((torch.zeros(1), 3), "tuple of ['Tensor', 'int']"),
    ((), "is a tuple of []"),
])
def test_what_cannot_cross_a_boundary_is_named_with_the_fix(payload: object, named: str) -> None:
    with pytest.raises(TypeError, match="stage 0") as info:
        check_payload(payload, "the output of stage 0")
    assert named in str(info.value) and "instead of a dict or a dataclass" in str(info.value)


def test_tensors_and_tuples_of_tensors_cross() -> None:
    check_payload(torch.zeros(2))
    check_payload((torch.zeros(2), torch.zeros(2, dtype=torch.bool)))
