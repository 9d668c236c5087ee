"""The emulated GPT: a tiny real embedding and head around one :class:`EmulatedLayer` per stage.

``build(costs, num_stages)`` returns ``(PipelineModule, Dataset)`` built the way DeepSpeed users build
them: a layer list of ``LayerSpec``s partitioned by ``type:EmulatedLayer`` (one emulated layer a stage; the
embedding joins the first stage and the head the last), a ``loss_fn``, and a map-style dataset whose item
``i`` is a pure function of ``i``. ``costs`` is a profile (see :mod:`.profiles`): stage ``s``'s layer sleeps
``F[s]``, ``B[s]``, ``W[s]`` milliseconds. ``topology=`` passes through to ``PipelineModule``.

``build_layers(layer_ms, parts)`` builds the same model from per-layer costs instead (a layer-costs file, see
:func:`layer_costs_ms`): the embedding, one :class:`EmulatedLayer` per listed block (a transformer layer's
F, B, W; the head's compute as one more), the real head; cut at ``parts`` (DeepSpeed's ``PipelineModule.parts``),
which is how a job runs re-partitioned layers.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule
from torch import nn
from torch.utils.data import Dataset

from benchmarks.emulated.layers import EmulatedLayer

__all__ = ["VOCAB", "SEQ", "WIDTH", "TokenDataset", "build", "build_layers", "PartitionedModule"]

VOCAB = 16
SEQ = 4
WIDTH = 8


class TokenDataset(Dataset):
    """``(tokens[SEQ], next tokens[SEQ])``: ``i, i+1, ...`` modulo the vocabulary, so the head can learn it."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        seq = (index + torch.arange(SEQ + 1)) % VOCAB
        return seq[:-1], seq[1:]


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


def build(costs: dict[str, Any], num_stages: int, topology: Any = None) -> tuple[PipelineModule, TokenDataset]:
    """The emulated GPT for ``num_stages`` stages with ``costs``' per-stage F/B/W (milliseconds)."""
    for kind in ("F", "B", "W"):
        if len(costs[kind]) != num_stages:
            raise ValueError(f"costs.{kind} has {len(costs[kind])} stages, the model {num_stages}: "
                             f"make the profile for {num_stages} stages")
    torch.manual_seed(0)
    layers: list[Any] = [LayerSpec(nn.Embedding, VOCAB, WIDTH)]
    layers += [LayerSpec(EmulatedLayer, costs["F"][s] / 1e3, costs["B"][s] / 1e3, costs["W"][s] / 1e3, WIDTH)
               for s in range(num_stages)]
    layers.append(LayerSpec(nn.Linear, WIDTH, VOCAB))
    where = {"topology": topology} if topology is not None else {"num_stages": num_stages}
    net = PipelineModule(layers=layers, loss_fn=_loss, partition_method="type:EmulatedLayer",
                         activation_checkpoint_interval=0, **where)
    return net, TokenDataset()


class PartitionedModule(PipelineModule):
    """A ``PipelineModule`` cut at given layer boundaries (``parts``, ``S + 1`` of them) instead of by a method."""

    def __init__(self, *args: Any, parts: Sequence[int], **kwargs: Any) -> None:
        self._given_parts = [int(x) for x in parts]
        super().__init__(*args, **kwargs)

    def _partition_layers(self, method: str = "uniform") -> None:
        if len(self._given_parts) != self.num_stages + 1 or self._given_parts[-1] != len(self._layer_specs):
            raise ValueError(f"parts {self._given_parts}: give {self.num_stages + 1} boundaries from 0 to "
                             f"{len(self._layer_specs)} (the module's layers)")
        self.parts = list(self._given_parts)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


def build_layers(layer_ms: dict[str, Any], parts: Sequence[int], num_stages: int,
                 topology: Any = None) -> tuple[PipelineModule, TokenDataset]:
    """The emulated GPT from per-layer costs (milliseconds; the first entry is the embedding, the last the real
    head, both free; every other entry an :class:`EmulatedLayer`), cut at ``parts``."""
    n = len(layer_ms["F"])
    for kind in ("F", "B", "W"):
        if len(layer_ms[kind]) != n or n < 3:
            raise ValueError(f"layer costs: {kind} has {len(layer_ms[kind])} entries, F {n}: one per layer, "
                             f"the embedding first and the head last")
    torch.manual_seed(0)
    layers: list[Any] = [LayerSpec(nn.Embedding, VOCAB, WIDTH)]
    layers += [LayerSpec(EmulatedLayer, layer_ms["F"][i] / 1e3, layer_ms["B"][i] / 1e3, layer_ms["W"][i] / 1e3, WIDTH)
               for i in range(1, n - 1)]
    layers.append(LayerSpec(nn.Linear, WIDTH, VOCAB))
    where = {"topology": topology} if topology is not None else {"num_stages": num_stages}
    net = PartitionedModule(layers=layers, loss_fn=_loss, parts=parts, activation_checkpoint_interval=0, **where)
    return net, TokenDataset()
