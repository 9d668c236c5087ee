"""The boundary log: the tensors a worker sent and received at its stage boundaries, until they are final.

A stage steps as soon as its own gradients are complete (the staggered optimizer step), so when a worker
fails, some stages may have stepped the interrupted iteration and others not. A stage that stepped cannot
run its forward or backward of that iteration again (its parameters moved on), yet a survivor of a
neighbouring stage that has not stepped may need what it sent: the activation a failed worker received
from it, the gradient it sent a failed worker. Rather than keep copies of the model state to roll stages
back, every worker keeps *references* to its boundary tensors (no copy: the sent activation is the stage
output, the sent gradient is the fresh input gradient, a received tensor is the buffer it arrived in):

=============  ========================================================================================
``sent``       activations sent to the next stage, input gradients sent to the previous stage
``received``   activations received from the previous stage, output gradients from the next stage
=============  ========================================================================================

An entry is dropped as soon as no repair can ask for it:

- what the worker *received* in iteration ``k``, at its own step of ``k``: its stage is then committed for
  ``k`` and runs nothing of it again, and only an uncommitted stage asks for a received entry;
- what it *sent* to a peer in iteration ``k``, when a message of iteration ``k + 1`` arrives from that peer:
  the peer has begun ``k + 1``, so it stepped ``k`` and its stage is committed for ``k``;
- anything of ``k`` left, when the worker starts ``k + 2``: by then every stage has stepped ``k`` (a stage
  starts ``k + 2`` only after the first stage's step of ``k + 1``, which needs every stage's input gradients
  of ``k + 1``, which every stage computes only after its step of ``k``).

So the log holds about one iteration of boundary tensors, at most ``4 x M x`` (boundary tensor) on an
interior stage (``2 x M x`` on the first and last), of the order of the activations a stage holds anyway.
:attr:`BoundaryLog.peak_bytes` is the most it referenced at once. On an accelerator, those references keep device
memory that W would otherwise free; ``on_host`` (``recycle.boundary_log: "pinned_host"``) keeps a copy in pinned
host memory instead, made as each tensor is sent or received (one device-to-host copy per boundary tensor, queued
on the stream, :func:`~ds_recycle.engine.devices.offload`), and moves it back to the device when a repair asks for
it.

Sends of an iteration complete before the stage steps (``WaitSends`` precedes
``StaggeredOptimizerStep``), so whatever a stepped worker sent, its receiver holds: a tensor is lost only
when its sender and its receiver both fail in the same window (then the job falls back to its checkpoint).
"""
from __future__ import annotations

import enum
from collections.abc import Iterator

import torch

from ds_recycle.engine.devices import HOST, offload
from ds_recycle.engine.instructions import MicroBatch
from ds_recycle.engine.p2p import Channel, Payload

__all__ = ["BoundaryLog", "LogKey", "Role"]


class Role(enum.Enum):
    """Which end of the transfer this worker was."""

    SENT = "sent"
    RECEIVED = "received"


LogKey = tuple[int, Channel, Role, MicroBatch]
"""``(iteration, channel, role, micro-batch)``."""


def _nbytes(payload: Payload) -> int:
    tensors = (payload,) if isinstance(payload, torch.Tensor) else payload
    return sum(t.numel() * t.element_size() for t in tensors)


class BoundaryLog:
    """References to one worker's boundary tensors of the iterations not yet final everywhere."""

    def __init__(self, on_host: bool = False) -> None:
        """``on_host``: keep host copies, not references (see the module docstring)."""
        self.on_host = on_host
        self._entries: dict[LogKey, Payload] = {}
        self._to: dict[LogKey, int] = {}
        """Sent entries -> the rank they went to."""
        self._heard: set[tuple[int, int]] = set()
        """``(iteration, peer)`` pairs whose first message released that peer's entries of the iteration before."""
        self._bytes = 0
        self.peak_bytes = 0
        """The most bytes the log has referenced at once (tensors it keeps alive, not copies)."""

    def record(self, iteration: int, channel: Channel, role: Role, mb: MicroBatch, payload: Payload,
               peer: int | None = None) -> None:
        """Keep ``payload``; ``peer``: the rank a sent entry went to, or the rank a received one came from."""
        key = (iteration, channel, role, (mb[0], mb[1]))
        self._drop(key)
        if self.on_host:
            payload = offload(payload) if isinstance(payload, torch.Tensor) else tuple(offload(t) for t in payload)
        self._entries[key] = payload
        self._bytes += _nbytes(payload)
        self.peak_bytes = max(self.peak_bytes, self._bytes)
        if role is Role.SENT and peer is not None:
            self._to[key] = peer
        elif role is Role.RECEIVED and peer is not None:
            self.heard_from(iteration, peer)

    def heard_from(self, iteration: int, peer: int) -> None:
        """A message of ``iteration`` came from ``peer``: it stepped ``iteration - 1``, so what this worker sent it
        then is final."""
        if (iteration, peer) in self._heard:
            return
        self._heard = {h for h in self._heard if h[0] >= iteration - 1}
        self._heard.add((iteration, peer))
        for key in [key for key, to in self._to.items() if to == peer and key[0] == iteration - 1]:
            self._drop(key)

    def stepped(self, iteration: int) -> None:
        """This worker took its step of ``iteration``: its stage is committed, nothing it received then is asked for."""
        for key in [key for key in self._entries if key[0] == iteration and key[2] is Role.RECEIVED]:
            self._drop(key)

    def get(self, iteration: int, channel: Channel, role: Role, mb: MicroBatch,
            device: torch.device = HOST) -> Payload:
        """The entry, on ``device`` (a host copy goes back there; a reference is returned as it is)."""
        try:
            payload = self._entries[(iteration, channel, role, (mb[0], mb[1]))]
        except KeyError:
            raise RuntimeError(f"the boundary log holds no {role.value} {channel.name.lower()} of micro-batch {mb} "
                               f"of iteration {iteration}") from None
        if not self.on_host or device == HOST:
            return payload
        return payload.to(device) if isinstance(payload, torch.Tensor) else tuple(t.to(device) for t in payload)

    def held(self, iteration: int) -> Iterator[tuple[Channel, Role, MicroBatch]]:
        """What the log holds of ``iteration``."""
        for (k, channel, role, mb) in self._entries:
            if k == iteration:
                yield channel, role, mb

    def begin(self, iteration: int) -> None:
        """A new iteration starts: forget what every stage has stepped already (``< iteration - 1``)."""
        for key in [key for key in self._entries if key[0] < iteration - 1]:
            self._drop(key)

    def discard_from(self, iteration: int) -> None:
        """Forget ``iteration`` and later ones (work that is thrown away and done again)."""
        for key in [key for key in self._entries if key[0] >= iteration]:
            self._drop(key)
        self._heard = {h for h in self._heard if h[0] < iteration}

    def nbytes(self) -> int:
        """Bytes of the tensors referenced now (shared storage counted once per entry)."""
        return self._bytes

    def _drop(self, key: LogKey) -> None:
        payload = self._entries.pop(key, None)
        if payload is not None:
            self._bytes -= _nbytes(payload)
        self._to.pop(key, None)

    def __len__(self) -> int:
        return len(self._entries)
