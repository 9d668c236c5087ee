"""Per-micro-batch randomness: dropout masks follow the micro-batch, not the worker that runs it.

In vanilla DeepSpeed a stage's forward draws from its worker's global torch RNG, so the masks a
micro-batch gets depend on which worker runs it and on everything that worker drew before. Once ReCycle
re-routes a failed pipeline's micro-batch to a peer, or replays it, those masks would change and so would
the model. :func:`micro_batch_rng` wraps one forward: inside it torch's global RNG (the CPU generator, and
the CUDA generator of the chosen device) starts from a state seeded by
``(seed, step, pipeline, index, stage)`` alone; afterwards the outer state is back as it was::

    with micro_batch_rng(seed, step=engine.global_steps, pipeline=owner, index=micro_batch_id,
                         stage=engine.stage_id):
        outputs = stage_module(inputs)

Activation checkpointing: DeepSpeed's ``checkpointing.checkpoint`` (and torch's, with its default
``preserve_rng_state=True``) records the CPU and accelerator RNG states when the checkpointed segment
first runs (``deepspeed/runtime/activation_checkpointing/checkpointing.py:620-622``; ``:846-848`` for the
non-reentrant variant) and puts them back for the recomputation during backward, restoring the
backward-time states after (``:726-744``; ``:962-979``). Run inside
this context, the recorded state is the micro-batch's own, so the recomputation redraws the same masks
wherever and whenever backward runs; the backward itself needs no context. DeepSpeed's model-parallel
``get_cuda_rng_tracker()`` states (Megatron-style ``fork()`` regions) are separate generators this context
does not reseed.

Limits: the CPU generator (mt19937) keeps only the low 32 bits of a seed, so on CPU two micro-batches
share masks with probability 2**-32 per pair (the CUDA Philox generator uses all 64 bits). Python's
``random`` and numpy are not touched. Reseeding is not allowed while a CUDA graph is being captured.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

__all__ = ["LAYER_STREAMS", "LayerSeeds", "micro_batch_rng", "micro_batch_seed"]

LAYER_STREAMS = 1 << 20
"""``stage`` coordinate of layer ``i``'s stream is ``LAYER_STREAMS + i`` (clear of every stage's)."""

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One round of the SplitMix64 finalizer: a bijection of 64-bit words that mixes every bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def micro_batch_seed(seed: int, step: int, pipeline: int, index: int, stage: int) -> int:
    """A well-mixed 64-bit seed for one (step, pipeline, micro-batch index, stage) of a run seeded ``seed``.

    Each coordinate is folded in by a bijective mix, so changing any one of them (the others fixed) always
    changes the seed; its low 32 bits (all the CPU generator uses) depend on every input bit."""
    for name, value in (("step", step), ("pipeline", pipeline), ("index", index), ("stage", stage)):
        if value < 0:
            raise ValueError(f"micro_batch_seed: {name}={value} must be non-negative")
    h = _splitmix64(seed & _MASK64)
    for value in (step, pipeline, index, stage):
        h = _splitmix64(h ^ (value & _MASK64))
    return h


def _cuda_generator(device: torch.device | str | int | None) -> torch.Generator | None:
    """The CUDA default generator to reseed: ``device``'s, or the current device's when ``device`` is None
    and CUDA is available; None for a CPU device or a machine without CUDA."""
    if device is None:
        if not torch.cuda.is_available():
            return None
        return torch.cuda.default_generators[torch.cuda.current_device()]
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        raise ValueError(f"micro_batch_rng: device {dev} is neither cpu nor cuda; pass the stage's CUDA device "
                         "or cpu (other accelerators' generators are not reseeded)")
    torch.cuda.init()  # default_generators is filled on initialization
    return torch.cuda.default_generators[dev.index if dev.index is not None else torch.cuda.current_device()]


@contextmanager
def micro_batch_rng(seed: int, step: int, pipeline: int, index: int, stage: int,
                    device: torch.device | str | int | None = None) -> Iterator[int]:
    """Make the body draw from torch RNG states seeded by the five numbers; restore the outer states after.

    Reseeded: the CPU default generator, and the CUDA default generator of ``device`` (default: the
    current CUDA device when CUDA is available; ``"cpu"``: none). Yields the 64-bit seed. The outer states
    come back also when the body raises, and contexts nest."""
    value = micro_batch_seed(seed, step, pipeline, index, stage)
    cpu = torch.default_generator
    cuda = _cuda_generator(device)
    cpu_state = cpu.get_state()
    cuda_state = cuda.get_state() if cuda is not None else None
    cpu.manual_seed(value)
    if cuda is not None:
        cuda.manual_seed(value)
    try:
        yield value
    finally:
        cpu.set_state(cpu_state)
        if cuda is not None and cuda_state is not None:
            cuda.set_state(cuda_state)


class LayerSeeds:
    """Per-layer streams: before each layer's forward, torch's RNG is seeded by ``(seed, step, pipeline, index,
    LAYER_STREAMS + layer)``, so a layer draws the same dropout masks on whichever stage holds it (a job whose layers
    move between stages, :mod:`ds_recycle.engine.layer_move`). Only inside :meth:`micro_batch`; the enclosing
    :func:`micro_batch_rng` restores the outer state after the stage's forward."""

    def __init__(self, seed: int, device: torch.device | str | int | None = None) -> None:
        self.seed = seed
        self._current: tuple[int, int, int] | None = None
        self._handles: list[Any] = []
        self._generators = [g for g in (torch.default_generator, _cuda_generator(device)) if g is not None]
        """The generators :func:`micro_batch_rng` reseeds (a generator's own ``manual_seed``: about 1 us, against
        60 us for ``torch.manual_seed``, which visits every backend)."""

    def attach(self, layers: Mapping[int, Any]) -> None:
        """Hook ``layers`` (global index -> layer; modules only), replacing the hooks of an earlier call."""
        for handle in self._handles:
            handle.remove()
        self._handles = [layer.register_forward_pre_hook(partial(self._before, int(index)))
                         for index, layer in layers.items() if isinstance(layer, nn.Module)]

    @contextmanager
    def micro_batch(self, step: int, pipeline: int, index: int) -> Iterator[None]:
        self._current = (step, pipeline, index)
        try:
            yield
        finally:
            self._current = None

    def _before(self, layer: int, module: nn.Module, args: object) -> None:
        if self._current is not None:
            step, pipeline, index = self._current
            value = micro_batch_seed(self.seed, step, pipeline, index, LAYER_STREAMS + layer)
            for generator in self._generators:
                generator.manual_seed(value)
