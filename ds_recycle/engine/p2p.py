"""Point-to-point transfers between any two workers, by global rank, on an explicit group.

DeepSpeed's ``pipe.p2p`` only talks to the adjacent stage of the *same* pipeline, on the WORLD group,
with blocking sends (a gloo send is a rendezvous). Here:

- sends are posted with ``isend`` and kept until :meth:`PeerChannel.wait_sends` (bounded by the group
  timeout), so no worker ever blocks on a send;
- receives block right before the op that needs the tensor;
- every message carries a tag made of its kind, iteration and micro-batch, so messages between the same
  two workers match by identity, not by arrival order;
- the first activation a worker sends to a given peer is preceded by a small shape/dtype header; the
  receiver caches it per peer. Gradients have the shape of the activation that went the other way.
"""
from __future__ import annotations

import enum
import logging
from typing import Any

import torch
import torch.distributed as dist

from ds_recycle.engine.instructions import MicroBatch

__all__ = ["Channel", "PeerChannel"]

logger = logging.getLogger(__name__)

_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_META_LEN = 8


class Channel(enum.Enum):
    """What a message carries; part of its tag."""

    META = 0
    """Shape and dtype header of the activations from one peer (sent once)."""
    ACTIVATION = 1
    """A stage output going to the next stage."""
    GRAD = 2
    """The gradient of a stage input going back to the previous stage."""


class PeerChannel:
    """Tagged, explicit-peer sends and receives for one worker."""

    def __init__(self, group: Any, pipelines: int, microbatches: int) -> None:
        self.group = group
        self.pipelines = pipelines
        self.microbatches = microbatches
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self._meta_sent: set[int] = set()
        self._meta_recv: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}

    def _tag(self, channel: Channel, iteration: int, mb: MicroBatch) -> int:
        slot = mb[0] * self.microbatches + mb[1]
        return ((iteration % 4) * 3 + channel.value) * self.pipelines * self.microbatches + slot + 1

    def send(self, tensor: torch.Tensor, peer: int, channel: Channel, iteration: int, mb: MicroBatch) -> None:
        """Post ``tensor`` to ``peer``; the tensor must not change until :meth:`wait_sends`."""
        if channel is Channel.ACTIVATION and peer not in self._meta_sent:
            self._post(self._meta_of(tensor), peer, 0)
            self._meta_sent.add(peer)
        self._post(tensor.contiguous(), peer, self._tag(channel, iteration, mb))

    def _post(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        work = dist.isend(tensor, dst=peer, group=self.group, tag=tag)
        self._pending.append((work, tensor))

    def recv_activation(self, peer: int, iteration: int, mb: MicroBatch) -> torch.Tensor:
        """Block until the activation of ``mb`` from ``peer`` arrives; returns a fresh tensor."""
        if peer not in self._meta_recv:
            meta = torch.zeros(_META_LEN, dtype=torch.int64)
            dist.recv(meta, src=peer, group=self.group, tag=0)
            self._meta_recv[peer] = self._parse_meta(meta, peer)
        shape, dtype = self._meta_recv[peer]
        return self.recv_like(torch.empty(shape, dtype=dtype), peer, Channel.ACTIVATION, iteration, mb)

    def recv_like(self, buffer: torch.Tensor, peer: int, channel: Channel, iteration: int,
                  mb: MicroBatch) -> torch.Tensor:
        """Block until the message of ``mb`` on ``channel`` from ``peer`` fills ``buffer``."""
        dist.recv(buffer, src=peer, group=self.group, tag=self._tag(channel, iteration, mb))
        return buffer

    def wait_sends(self) -> None:
        """Wait until every posted send was received (each wait bounded by the group timeout)."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()

    @staticmethod
    def _meta_of(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype not in _DTYPES or tensor.dim() > _META_LEN - 2:
            raise TypeError(f"cannot send a stage output of dtype {tensor.dtype} with {tensor.dim()} dims; "
                            f"stages must exchange one floating tensor of at most {_META_LEN - 2} dims")
        meta = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
        return torch.tensor(meta + [0] * (_META_LEN - len(meta)), dtype=torch.int64)

    @staticmethod
    def _parse_meta(meta: torch.Tensor, peer: int) -> tuple[tuple[int, ...], torch.dtype]:
        values = meta.tolist()
        dtype_id, ndim = values[0], values[1]
        if not (0 <= dtype_id < len(_DTYPES) and 0 <= ndim <= _META_LEN - 2):
            raise RuntimeError(f"malformed activation header from rank {peer}: {values}")
        return tuple(values[2:2 + ndim]), _DTYPES[dtype_id]
