"""Point-to-point transfers between any two workers, by global rank, on an explicit group.

DeepSpeed's ``pipe.p2p`` only talks to the adjacent stage of the *same* pipeline, on the WORLD group,
with blocking sends (a gloo send is a rendezvous). Here:

- sends are posted with ``isend`` and kept until :meth:`PeerChannel.wait_sends` (bounded by the group
  timeout), so no worker ever blocks on a send;
- receives block right before the op that needs the tensor;
- messages carry no tags: between two workers they match in the order they were posted (NCCL's
  discipline, which ignores tags; the engine posts each pair's sends and receives in one order, see
  :mod:`ds_recycle.engine.nccl_check`), and a receive names its message (kind, iteration, micro-batch)
  only in errors. With ``DS_RECYCLE_CHECK_ORDER=1`` in the environment every message is preceded by its
  name (kind, iteration, micro-batch: four integers), which the receiver compares with what it expects, so that a
  message taken out of order fails at once, naming both (the test suite runs this way);
- a payload is one tensor or a tuple of tensors (:data:`Payload`) of any dtype in :data:`DTYPES`; a
  tuple travels as one message per element, posted together;
- the first activation a worker sends to a given peer is preceded by a small header (tuple or not, each
  tensor's dtype and shape, and whether the sender names its messages); the receiver caches it per peer. Gradients need no header: they have
  the shapes of the floating-point tensors of the activation that went the other way.
"""
from __future__ import annotations

import enum
import logging
import os
from typing import Any

import torch

from ds_recycle.engine.devices import HOST
from ds_recycle.engine.instructions import MicroBatch
from ds_recycle.engine.transport import Transport

__all__ = ["CHECK_ORDER_ENV", "DTYPES", "Channel", "Payload", "PeerChannel", "check_payload", "decode_header",
           "encode_header", "header_checks_order"]

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

CHECK_ORDER_ENV = "DS_RECYCLE_CHECK_ORDER"
"""Environment variable: ``1`` makes every :class:`PeerChannel` check each message's place in its pair's order."""


class Channel(enum.Enum):
    """What a message carries."""

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


def encode_header(payload: Payload, check_order: bool = False, device: torch.device = HOST) -> torch.Tensor:
    """The ``int64`` header that describes ``payload`` (see :func:`decode_header`), and whether its sender names
    every message (:func:`header_checks_order`); made on ``device`` (the transport's)."""
    check_payload(payload)
    bare = isinstance(payload, torch.Tensor)
    tensors = [payload] if isinstance(payload, torch.Tensor) else list(payload)
    meta = [0 if bare else len(tensors), int(check_order)] + [0] * (_RECORD - 2)
    for tensor in tensors:
        if tensor.dtype not in DTYPES or tensor.dim() > _RECORD - 2:
            raise TypeError(f"cannot send a stage output of dtype {tensor.dtype} with {tensor.dim()} dims; "
                            f"each tensor must have one of {[str(d) for d in DTYPES]} and at most "
                            f"{_RECORD - 2} dims")
        record = [DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
        meta += record + [0] * (_RECORD - len(record))
    return torch.tensor(meta + [0] * (_META_LEN - len(meta)), dtype=torch.int64, device=device)


def header_checks_order(meta: torch.Tensor) -> bool:
    """Whether the sender of header ``meta`` names every message it sends (``DS_RECYCLE_CHECK_ORDER``)."""
    return bool(int(meta[1]))


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
    """Explicit-peer sends and receives for one worker, matched per pair in posting order."""

    def __init__(self, transport: Transport, check_order: bool | None = None, device: torch.device = HOST) -> None:
        """``check_order``: send each message's name before it and compare it on receipt (None: as
        :data:`CHECK_ORDER_ENV` says); ``device``: where received activations are made (the stage's)."""
        self.transport = transport
        self.device = device
        self.check_order = os.environ.get(CHECK_ORDER_ENV) == "1" if check_order is None else check_order
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self._meta_sent: set[int] = set()
        self._meta_recv: dict[int, tuple[bool, list[TensorSpec]]] = {}

    def _name(self, channel: Channel, iteration: int, mb: MicroBatch) -> torch.Tensor:
        return torch.tensor([channel.value, iteration, mb[0], mb[1]], dtype=torch.int64, device=self.transport.device)

    @staticmethod
    def _what(channel: Channel, iteration: int, mb: MicroBatch) -> str:
        return f"{channel.name.lower()} of micro-batch {mb[0]}.{mb[1]}, iteration {iteration}"

    def send(self, payload: Payload, peer: int, channel: Channel, iteration: int, mb: MicroBatch) -> None:
        """Post ``payload`` to ``peer``; its tensors must not change until :meth:`wait_sends`."""
        if channel is Channel.ACTIVATION and peer not in self._meta_sent:
            self._post(encode_header(payload, self.check_order, self.transport.device), peer)
            self._meta_sent.add(peer)
        if self.check_order:
            self._post(self._name(channel, iteration, mb), peer)
        for tensor in (payload,) if isinstance(payload, torch.Tensor) else payload:
            self._post(tensor.contiguous(), peer)

    def recv_activation(self, peer: int, iteration: int, mb: MicroBatch) -> Payload:
        """Block until the activation of ``mb`` from ``peer`` arrives; returns fresh tensors."""
        if peer not in self._meta_recv:
            meta = torch.zeros(_META_LEN, dtype=torch.int64, device=self.transport.device)
            self.transport.recv((meta,), peer, "the activation header")
            if header_checks_order(meta) != self.check_order:
                raise RuntimeError(f"rank {peer} {'names' if header_checks_order(meta) else 'does not name'} its "
                                   f"messages and this worker {'does' if self.check_order else 'does not'}: set "
                                   f"{CHECK_ORDER_ENV} alike for every worker of the job (ds-recycle launch passes it "
                                   "to the nodes it starts over ssh)")
            self._meta_recv[peer] = decode_header(meta, peer)
        is_tuple, specs = self._meta_recv[peer]
        buffers = tuple(torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in specs)
        return self.recv_like(buffers if is_tuple else buffers[0], peer, Channel.ACTIVATION, iteration, mb)

    def recv_like(self, buffer: Payload, peer: int, channel: Channel, iteration: int, mb: MicroBatch) -> Payload:
        """Block until the message of ``mb`` on ``channel`` from ``peer`` fills ``buffer`` (a tensor or a tuple);
        it must be the next one ``peer`` sent this worker."""
        buffers = (buffer,) if isinstance(buffer, torch.Tensor) else tuple(buffer)
        what = self._what(channel, iteration, mb)
        if self.check_order:
            name = torch.zeros(4, dtype=torch.int64, device=self.transport.device)
            self.transport.recv((name,), peer, f"the name of the {what}")
            if not torch.equal(name, self._name(channel, iteration, mb)):
                got = Channel(int(name[0])).name.lower() if 0 <= int(name[0]) < len(Channel) else f"channel {name[0]}"
                raise RuntimeError(f"message order broken: rank {peer}'s next message to this worker is the {got} of "
                                   f"micro-batch {int(name[2])}.{int(name[3])}, iteration {int(name[1])}; this "
                                   f"worker expected the {what} (messages match per pair in posting order)")
        self.transport.recv(buffers, peer, what)
        return buffer

    def _post(self, tensor: torch.Tensor, peer: int) -> None:
        self._pending.append((self.transport.isend(tensor, peer), tensor))

    def wait_sends(self) -> None:
        """Wait until every posted send was received."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            self.transport.wait(work, "send completion")
