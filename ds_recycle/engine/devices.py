"""Where the engine's tensors live.

Two rules keep the engine device-generic (a test scans ``ds_recycle/engine`` and ``ds_recycle/resilience`` for a
tensor made without naming its device):

- **data** (boundary tensors, gradients, reductions, norms, losses) is made on the device of the stage's
  parameters, :func:`device_of`: the worker's accelerator, or the CPU of a CPU job;
- **control messages** (headers, message names, sizes, serialized state, measurement rows) are made on the device
  of the transport that carries them (:attr:`ds_recycle.engine.transport.Transport.device`: the host for gloo, the
  rank's GPU for NCCL), so that they travel without a copy.

Gloo carries host tensors only (its sends, receives, all-gathers and all-to-alls refuse CUDA tensors: the backend
table of ``torch.distributed``'s documentation). Where gloo carries a GPU's data (ranks that share one GPU), the
transports stage it: a host copy of each input is sent, each output is
received into a host tensor and copied back once the operation is waited for (:func:`staged`); the host tensors are
pinned. On the host nothing is copied.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["HOST", "StagedWork", "device_of", "host_buffer", "host_copy", "offload", "staged"]

HOST = torch.device("cpu")
"""The host: what gloo carries, and where host-side bookkeeping lives."""


def device_of(module: nn.Module) -> torch.device:
    """The device of ``module``'s first parameter (or buffer); the host for a module that holds neither."""
    for parameter in module.parameters():
        return parameter.device
    for buffer in module.buffers():
        return buffer.device
    return HOST


# ------------------------------------------------------------------------------------ host staging (gloo on a GPU)
_pinned = True
"""Whether staging buffers are page-locked (pinned): copies between a GPU and pinned memory run at the link's full
speed, where pageable memory goes through the driver's own staging; torch's caching host allocator reuses them.
Turned off for the process if pinning fails (a host that refuses page-locked memory): pageable buffers work too."""


def _staging_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """An empty host tensor shaped like ``tensor`` (an accelerator's), pinned where the host allows."""
    global _pinned
    if _pinned:
        try:
            return torch.empty(tensor.shape, dtype=tensor.dtype, device=HOST, pin_memory=True)
        except RuntimeError as err:
            _pinned = False
            logger.warning("pinned host memory refused (%s): staging through pageable memory", err)
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=HOST)


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """What gloo sends for ``tensor``: ``tensor`` itself on the host, else a host copy of it (made now: the copy
    returns once the data is on the host)."""
    if tensor.device == HOST:
        return tensor
    return _staging_buffer(tensor).copy_(tensor.detach())


def offload(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor`` (itself if on the host already), in pinned memory where the host allows: the copy
    is queued on the current stream and does not wait for it (the data is there for any later use on that
    stream, and by any host synchronization with it)."""
    if tensor.device == HOST:
        return tensor
    host = _staging_buffer(tensor)
    return host.copy_(tensor.detach(), non_blocking=host.is_pinned())


def host_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """Where gloo writes what ends in ``tensor``: ``tensor`` itself on the host, else an empty host tensor like it."""
    return tensor if tensor.device == HOST else _staging_buffer(tensor)


class StagedWork:
    """A gloo operation run on host copies of accelerator tensors (gloo sends, receives, gathers and exchanges host
    tensors only): :meth:`wait` waits for it, then copies each result back to its accelerator tensor. The host copies
    are held until then (gloo reads and writes them while the operation runs)."""

    def __init__(self, work: Any, back: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
                 keep: Sequence[torch.Tensor] = ()) -> None:
        """``back``: ``(accelerator tensor, host tensor)`` pairs to copy once done; ``keep``: host inputs."""
        self.work = work
        self._back = list(back)
        self._keep = list(keep)

    def wait(self, timeout: timedelta | None = None) -> bool:
        done = bool(self.work.wait() if timeout is None else self.work.wait(timeout))
        for target, host in self._back:
            target.copy_(host)
        self._back, self._keep = [], []
        return done


def staged(work: Any, outputs: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
           inputs: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> Any:
    """``work`` as it is when every tensor was on the host already, else a :class:`StagedWork` for it. ``outputs``
    and ``inputs``: ``(tensor, host tensor used)`` pairs, from :func:`host_buffer` and :func:`host_copy`."""
    back = [(t, h) for t, h in outputs if h is not t]
    keep = [h for t, h in inputs if h is not t]
    return StagedWork(work, back, keep) if back or keep else work
