"""Point-to-point transfers between any two workers, by global rank, on an explicit group.

DeepSpeed's ``pipe.p2p`` only talks to the adjacent stage of the *same* pipeline, on the WORLD group,
with blocking sends (a gloo send is a rendezvous). Here:

- sends are posted asynchronously and kept until :meth:`PeerChannel.wait_sends` (bounded by the group
  timeout), so no worker ever blocks on a send;
- receives are posted ahead (the engine's: in batches, in the job's match order, see
  :mod:`ds_recycle.engine.issue`) and waited for right before the op that needs the tensor;
- messages carry no tags: between two workers they match in the order they were posted (NCCL's
  discipline, which ignores tags; :mod:`ds_recycle.engine.nccl_check` proves a plan's order without running it),
  and a receive names its message (kind, iteration, micro-batch) only in errors. With ``DS_RECYCLE_CHECK_ORDER=1``
  in the environment every message is preceded by its name (kind, iteration, micro-batch: four integers), which the
  receiver compares with what it expects, so that a message taken out of order fails at once, naming both (the test
  suite runs this way);
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ds_recycle.engine.devices import HOST
from ds_recycle.engine.instructions import MicroBatch, Transfer
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
_Op = tuple[bool, torch.Tensor, int, "list[tuple[Any, torch.Tensor]]"]
"""An operation to post: (is a send, tensor, peer, where its work goes)."""

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


_Key = tuple[int, Channel, MicroBatch]
"""A message of one iteration as a channel files it: (peer, channel, micro-batch)."""
_Sink = list[tuple[Any, torch.Tensor]]
"""Where the works of posted operations go, each with its tensor (kept alive until it is waited for)."""


@dataclass
class _Posted:
    """A receive posted ahead of the instruction that takes it."""

    what: str
    name: torch.Tensor | None
    buffers: tuple[torch.Tensor, ...]
    is_tuple: bool
    works: _Sink = field(default_factory=list)


class PeerChannel:
    """Explicit-peer sends and receives for one worker, matched per pair in posting order.

    Two ways to use it. Immediate: :meth:`send` posts at once, :meth:`recv_activation` and :meth:`recv_like` post
    and wait. Issued (``issued=True``, the engine's): :meth:`send` hands the tensors over, :meth:`post` posts a batch
    of transfers together (sends handed over earlier, receives into fresh buffers), and the receive calls wait for
    what was posted (:mod:`ds_recycle.engine.issue` decides the batches)."""

    def __init__(self, transport: Transport, check_order: bool | None = None, device: torch.device = HOST,
                 issued: bool = False) -> None:
        """``check_order``: send each message's name before it and compare it on receipt (None: as
        :data:`CHECK_ORDER_ENV` says); ``device``: where received activations are made (the stage's); ``issued``:
        sends wait for :meth:`post`, and receives may have been posted by it."""
        self.transport = transport
        self.device = device
        self.issued = issued
        self.check_order = os.environ.get(CHECK_ORDER_ENV) == "1" if check_order is None else check_order
        self._pending: _Sink = []
        self._meta_sent: set[int] = set()
        self._meta_recv: dict[int, tuple[bool, list[TensorSpec]]] = {}
        self._handed: dict[_Key, list[torch.Tensor]] = {}
        self._posted: dict[_Key, _Posted] = {}

    def _name(self, channel: Channel, iteration: int, mb: MicroBatch) -> torch.Tensor:
        return torch.tensor([channel.value, iteration, mb[0], mb[1]], dtype=torch.int64, device=self.transport.device)

    @staticmethod
    def _what(channel: Channel, iteration: int, mb: MicroBatch) -> str:
        return f"{channel.name.lower()} of micro-batch {mb[0]}.{mb[1]}, iteration {iteration}"

    def send(self, payload: Payload, peer: int, channel: Channel, iteration: int, mb: MicroBatch) -> None:
        """Post ``payload`` to ``peer`` (issued: hand it over to the :meth:`post` that names it); its tensors must not
        change until :meth:`wait_sends`."""
        tensors: list[torch.Tensor] = []
        if channel is Channel.ACTIVATION and peer not in self._meta_sent:
            tensors.append(encode_header(payload, self.check_order, self.transport.device))
            self._meta_sent.add(peer)
        if self.check_order:
            tensors.append(self._name(channel, iteration, mb))
        tensors += [t.contiguous() for t in ((payload,) if isinstance(payload, torch.Tensor) else payload)]
        if self.issued:
            self._handed[(peer, channel, mb)] = tensors
            return
        self._submit([(True, t, peer, self._pending) for t in tensors])

    def post(self, transfers: Sequence[Transfer], iteration: int,
             grad_like: Callable[[MicroBatch], Payload]) -> None:
        """Post ``transfers`` together, in order (one group of the transport): a send posts the tensors :meth:`send`
        was handed for it, a receive posts fresh buffers (an activation's as its peer's header says, a gradient's
        like ``grad_like(mb)``), which :meth:`recv_activation` or :meth:`recv_like` then waits for. The first
        activation from a peer waits for its header here: what is already in the batch is posted first."""
        ops: list[_Op] = []
        for t in transfers:
            channel = Channel.GRAD if t.channel == "grad" else Channel.ACTIVATION
            key = (t.peer, channel, t.mb)
            if t.kind == "send":
                tensors = self._handed.pop(key, None)
                if tensors is None:
                    raise RuntimeError(f"iteration {iteration}: the {t} is posted before its tensors were handed over "
                                       "(the schedule's transfers are out of order)")
                ops += [(True, x, t.peer, self._pending) for x in tensors]
                continue
            what = self._what(channel, iteration, t.mb)
            if channel is Channel.ACTIVATION and t.peer not in self._meta_recv:
                meta = torch.zeros(_META_LEN, dtype=torch.int64, device=self.transport.device)
                header: _Sink = []
                self._submit([*ops, (False, meta, t.peer, header)])
                ops = []
                self.transport.wait(header[0][0], f"the activation header from rank {t.peer}")
                self._take_header(meta, t.peer)
            if channel is Channel.ACTIVATION:
                is_tuple, specs = self._meta_recv[t.peer]
                buffers = tuple(torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in specs)
            else:
                like = grad_like(t.mb)
                is_tuple = not isinstance(like, torch.Tensor)
                buffers = (like,) if isinstance(like, torch.Tensor) else tuple(like)
            name = torch.zeros(4, dtype=torch.int64, device=self.transport.device) if self.check_order else None
            posted = self._posted[key] = _Posted(what, name, buffers, is_tuple)
            ops += [(False, x, t.peer, posted.works) for x in ((name,) if name is not None else ()) + buffers]
        self._submit(ops)

    def _submit(self, ops: Sequence[_Op]) -> None:
        if not ops:
            return
        works = self.transport.post_p2p([(is_send, tensor, peer) for is_send, tensor, peer, _ in ops])
        for (_, tensor, _, sink), work in zip(ops, works):
            sink.append((work, tensor))

    def _take_header(self, meta: torch.Tensor, peer: int) -> None:
        if header_checks_order(meta) != self.check_order:
            raise RuntimeError(f"rank {peer} {'names' if header_checks_order(meta) else 'does not name'} its "
                               f"messages and this worker {'does' if self.check_order else 'does not'}: set "
                               f"{CHECK_ORDER_ENV} alike for every worker of the job (ds-recycle launch passes it "
                               "to the nodes it starts over ssh)")
        self._meta_recv[peer] = decode_header(meta, peer)

    def recv_activation(self, peer: int, iteration: int, mb: MicroBatch) -> Payload:
        """Block until the activation of ``mb`` from ``peer`` arrives; returns fresh tensors."""
        posted = self._posted.pop((peer, Channel.ACTIVATION, mb), None)
        if posted is not None:
            return self._taken(posted, peer, Channel.ACTIVATION, iteration, mb)
        if peer not in self._meta_recv:
            meta = torch.zeros(_META_LEN, dtype=torch.int64, device=self.transport.device)
            self.transport.recv((meta,), peer, "the activation header")
            self._take_header(meta, peer)
        is_tuple, specs = self._meta_recv[peer]
        buffers = tuple(torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in specs)
        return self.recv_like(buffers if is_tuple else buffers[0], peer, Channel.ACTIVATION, iteration, mb)

    def recv_like(self, buffer: Payload | Callable[[], Payload], peer: int, channel: Channel, iteration: int,
                  mb: MicroBatch) -> Payload:
        """Block until the message of ``mb`` on ``channel`` from ``peer`` fills ``buffer`` (a tensor or a tuple, or
        what a callable makes; a posted receive fills its own buffers, returned instead); it must be the next one
        ``peer`` sent this worker."""
        posted = self._posted.pop((peer, channel, mb), None)
        if posted is not None:
            return self._taken(posted, peer, channel, iteration, mb)
        if callable(buffer):
            buffer = buffer()
        buffers = (buffer,) if isinstance(buffer, torch.Tensor) else tuple(buffer)
        what = self._what(channel, iteration, mb)
        if self.check_order:
            name = torch.zeros(4, dtype=torch.int64, device=self.transport.device)
            self.transport.recv((name,), peer, f"the name of the {what}")
            self._check_name(name, peer, channel, iteration, mb)
        self.transport.recv(buffers, peer, what)
        return buffer

    def _taken(self, posted: _Posted, peer: int, channel: Channel, iteration: int, mb: MicroBatch) -> Payload:
        for work, _ in posted.works:  # only the device reads what arrived (the name, checked here, is a test's)
            self.transport.wait_on_stream(work, f"receive {posted.what} from rank {peer}")
        if posted.name is not None:
            self._check_name(posted.name, peer, channel, iteration, mb)
        return posted.buffers if posted.is_tuple else posted.buffers[0]

    def _check_name(self, name: torch.Tensor, peer: int, channel: Channel, iteration: int, mb: MicroBatch) -> None:
        if not torch.equal(name, self._name(channel, iteration, mb)):
            got = Channel(int(name[0])).name.lower() if 0 <= int(name[0]) < len(Channel) else f"channel {name[0]}"
            raise RuntimeError(f"message order broken: rank {peer}'s next message to this worker is the {got} of "
                               f"micro-batch {int(name[2])}.{int(name[3])}, iteration {int(name[1])}; this "
                               f"worker expected the {self._what(channel, iteration, mb)} (messages match per pair in "
                               "posting order)")

    def wait_sends(self) -> None:
        """Wait until every posted send was received (issued: every send handed over must have been posted)."""
        if self._handed:
            unposted = ", ".join(f"{c.name.lower()} {mb[0]}.{mb[1]} to rank {p}" for p, c, mb in self._handed)
            raise RuntimeError(f"sends handed over and never posted: {unposted} (the schedule lacks their "
                               "PostTransfers)")
        pending, self._pending = self._pending, []
        for work, _ in pending:
            self.transport.wait(work, "send completion")
