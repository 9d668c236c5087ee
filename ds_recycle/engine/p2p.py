"""Point-to-point transfers between any two workers, by global rank, on an explicit group.

DeepSpeed's ``pipe.p2p`` only talks to the adjacent stage of the *same* pipeline, on the WORLD group,
with blocking sends (a gloo send is a rendezvous). Here:

- sends are posted with ``isend`` and kept until :meth:`PeerChannel.wait_sends` (bounded by the group
  timeout), so no worker ever blocks on a send;
- receives block right before the op that needs the tensor;
- every message carries a tag made of its kind, iteration, micro-batch and part (the position in a
  tuple), so messages between the same two workers match by identity, not by arrival order;
- a payload is one tensor or a tuple of tensors (:data:`Payload`) of any dtype in :data:`DTYPES`; a
  tuple travels as one message per element, posted together;
- the first activation a worker sends to a given peer is preceded by a small header (tuple or not, and
  each tensor's dtype and shape); the receiver caches it per peer. Gradients need no header: they have
  the shapes of the floating-point tensors of the activation that went the other way.
"""
from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from typing import Any

import torch

from ds_recycle.engine.instructions import MicroBatch
from ds_recycle.engine.transport import Transport

__all__ = ["DTYPES", "Channel", "Payload", "PeerChannel", "check_payload", "decode_header", "encode_header"]

logger = logging.getLogger(__name__)

Payload = torch.Tensor | tuple[torch.Tensor, ...]
"""What crosses a stage boundary: one tensor, or a tuple of tensors (e.g. ``(hidden, attention_mask)``)."""

DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                                   torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
"""Dtypes a payload may hold; a header names them by position."""
_RECORD = 8
"""Header slots per tensor: dtype, number of dims, then up to 6 sizes."""
_MAX_PARTS = 7
_META_LEN = _RECORD * (_MAX_PARTS + 1)
"""Header length: a first record (the tuple length, 0 for a bare tensor), then one record per tensor."""

TensorSpec = tuple[tuple[int, ...], torch.dtype]


class Channel(enum.Enum):
    """What a message carries; part of its tag."""

    META = 0
    """Shape and dtype header of the activations from one peer (sent once)."""
    ACTIVATION = 1
    """A stage output going to the next stage."""
    GRAD = 2
    """The gradient of a stage input going back to the previous stage."""


def check_payload(payload: object, where: str = "a stage output") -> None:
    """Raise ``TypeError`` unless ``payload`` can cross a stage boundary: a tensor, or a tuple or list of 1 to
    ``_MAX_PARTS`` tensors (a dict, a dataclass, a nested tuple or a number cannot)."""
    if isinstance(payload, torch.Tensor):
        return
    if isinstance(payload, (tuple, list)) and 1 <= len(payload) <= _MAX_PARTS and all(
            isinstance(t, torch.Tensor) for t in payload):
        return
    inner = f" of {[type(t).__name__ for t in payload]}" if isinstance(payload, (tuple, list)) else ""
    raise TypeError(f"{where} is a {type(payload).__name__}{inner}: what crosses a stage boundary must be a tensor "
                    f"or a tuple of 1 to {_MAX_PARTS} tensors (as in DeepSpeed's pipeline engine); return the "
                    "tensors as a tuple, e.g. (hidden, mask), instead of a dict or a dataclass")


def encode_header(payload: Payload) -> torch.Tensor:
    """The ``int64`` header that describes ``payload`` (see :func:`decode_header`)."""
    check_payload(payload)
    bare = isinstance(payload, torch.Tensor)
    tensors = [payload] if isinstance(payload, torch.Tensor) else list(payload)
    meta = [0 if bare else len(tensors)] + [0] * (_RECORD - 1)
    for tensor in tensors:
        if tensor.dtype not in DTYPES or tensor.dim() > _RECORD - 2:
            raise TypeError(f"cannot send a stage output of dtype {tensor.dtype} with {tensor.dim()} dims; "
                            f"each tensor must have one of {[str(d) for d in DTYPES]} and at most "
                            f"{_RECORD - 2} dims")
        record = [DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
        meta += record + [0] * (_RECORD - len(record))
    return torch.tensor(meta + [0] * (_META_LEN - len(meta)), dtype=torch.int64)


def decode_header(meta: torch.Tensor, peer: int) -> tuple[bool, list[TensorSpec]]:
    """``(is_tuple, [(shape, dtype) per tensor])`` from a header received from ``peer``."""
    values = meta.tolist()
    count = values[0]
    if not 0 <= count <= _MAX_PARTS:
        raise RuntimeError(f"malformed activation header from rank {peer}: {values}")
    specs: list[TensorSpec] = []
    for k in range(1, max(count, 1) + 1):
        record = values[k * _RECORD:(k + 1) * _RECORD]
        dtype_id, ndim = record[0], record[1]
        if not (0 <= dtype_id < len(DTYPES) and 0 <= ndim <= _RECORD - 2):
            raise RuntimeError(f"malformed activation header from rank {peer}: {values}")
        specs.append((tuple(record[2:2 + ndim]), DTYPES[dtype_id]))
    return count > 0, specs


class PeerChannel:
    """Tagged, explicit-peer sends and receives for one worker."""

    def __init__(self, transport: Transport, pipelines: int, microbatches: int) -> None:
        self.transport = transport
        self.pipelines = pipelines
        self.microbatches = microbatches
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self._meta_sent: set[int] = set()
        self._meta_recv: dict[int, tuple[bool, list[TensorSpec]]] = {}

    def _tag(self, channel: Channel, iteration: int, mb: MicroBatch, part: int = 0) -> int:
        slot = mb[0] * self.microbatches + mb[1]
        return (((part * 4 + iteration % 4) * 3 + channel.value) * self.pipelines * self.microbatches + slot + 1)

    def send(self, payload: Payload, peer: int, channel: Channel, iteration: int, mb: MicroBatch) -> None:
        """Post ``payload`` to ``peer``; its tensors must not change until :meth:`wait_sends`."""
        if channel is Channel.ACTIVATION and peer not in self._meta_sent:
            self._post(encode_header(payload), peer, 0)
            self._meta_sent.add(peer)
        if isinstance(payload, torch.Tensor):
            self._post(payload.contiguous(), peer, self._tag(channel, iteration, mb))
            return
        for part, tensor in enumerate(payload):
            self._post(tensor.contiguous(), peer, self._tag(channel, iteration, mb, part))

    def recv_activation(self, peer: int, iteration: int, mb: MicroBatch) -> Payload:
        """Block until the activation of ``mb`` from ``peer`` arrives; returns fresh tensors."""
        if peer not in self._meta_recv:
            meta = torch.zeros(_META_LEN, dtype=torch.int64)
            self._recv(meta, peer, 0)
            self._meta_recv[peer] = decode_header(meta, peer)
        is_tuple, specs = self._meta_recv[peer]
        buffers = tuple(torch.empty(shape, dtype=dtype) for shape, dtype in specs)
        return self.recv_like(buffers if is_tuple else buffers[0], peer, Channel.ACTIVATION, iteration, mb)

    def recv_like(self, buffer: Payload, peer: int, channel: Channel, iteration: int, mb: MicroBatch) -> Payload:
        """Block until the message of ``mb`` on ``channel`` from ``peer`` fills ``buffer`` (a tensor or a tuple)."""
        if isinstance(buffer, torch.Tensor):
            self._recv(buffer, peer, self._tag(channel, iteration, mb))
            return buffer
        self._recv_parts(buffer, peer, [self._tag(channel, iteration, mb, part) for part in range(len(buffer))])
        return buffer

    def _post(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        self._pending.append((self.transport.isend(tensor, peer, tag), tensor))

    def _recv(self, buffer: torch.Tensor, peer: int, tag: int) -> None:
        self.transport.recv((buffer,), peer, (tag,))

    def _recv_parts(self, buffers: Sequence[torch.Tensor], peer: int, tags: Sequence[int]) -> None:
        """Receive into several buffers: all posted first, then waited for."""
        self.transport.recv(buffers, peer, tags)

    def wait_sends(self) -> None:
        """Wait until every posted send was received."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            self.transport.wait(work, "send completion")
