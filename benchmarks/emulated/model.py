"""The emulated GPT: a tiny real embedding and head around one :class:`EmulatedLayer` per stage.

``build(costs, num_stages)`` returns ``(PipelineModule, Dataset)`` built the way DeepSpeed users build
them: a layer list of ``LayerSpec``s partitioned by ``type:EmulatedLayer`` (one emulated layer a stage; the
embedding joins the first stage and the head the last), a ``loss_fn``, and a map-style dataset whose item
``i`` is a pure function of ``i``. ``costs`` is a profile (see :mod:`.profiles`): stage ``s``'s layer sleeps
``F[s]``, ``B[s]``, ``W[s]`` milliseconds. ``topology=`` passes through to ``PipelineModule``.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule
from torch import nn
from torch.utils.data import Dataset

from benchmarks.emulated.layers import EmulatedLayer

__all__ = ["VOCAB", "SEQ", "WIDTH", "TokenDataset", "build"]

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
