"""Activation checkpointing that the B/W split can run: a non-reentrant recompute.

A ``PipelineModule`` built with ``activation_checkpoint_interval > 0`` runs each segment of that many layers
through ``activation_checkpoint_func``, by default DeepSpeed's reentrant ``checkpointing.checkpoint``: the
forward keeps no graph inside the segment, and the backward re-runs the segment and calls
``torch.autograd.backward`` on it, which accumulates the segment's weight gradients whatever the outer call
asked for. A B that asks autograd for input gradients only (``torch.autograd.grad``) would then either miss
the weight gradients or compute them in B, and W would find nothing to do.

:func:`recompute_checkpoint` keeps the segment's graph but not the tensors its nodes save: torch's
non-reentrant checkpoint (``use_reentrant=False``) frees them after the forward and recomputes them when a
backward pass first needs one. Each autograd call honours its ``inputs=``: B gets the input gradients only, W
the weight gradients only. Each of the two passes recomputes the segment once (DeepSpeed's reentrant
backward recomputes it once for both), so a checkpointed stage runs its forward three times per micro-batch
instead of two; the stage's W runs as one whole-stage pass (a per-owner W would recompute the segment once
per owner).

Randomness: ``preserve_rng_state=True`` records the CPU (and CUDA) generator state when the segment first
runs and restores it for each recompute. The forward runs inside
:func:`~ds_recycle.engine.rng.micro_batch_rng`, so the recorded state is the micro-batch's own and the
recomputed dropout masks are the forward's, wherever and whenever B and W run.

:func:`use_recompute` puts it in place of DeepSpeed's two checkpoint functions on a module; a function of the
user's own is refused (its recompute may not honour ``inputs=``).
"""
from __future__ import annotations

from typing import Any

import torch.utils.checkpoint

__all__ = ["recompute_checkpoint", "use_recompute"]


def recompute_checkpoint(function: Any, *args: Any) -> Any:
    """``function(*args)`` with its saved tensors recomputed in backward (non-reentrant, RNG state preserved)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True)


def use_recompute(module: Any) -> bool:
    """Make a ``PipelineModule`` with activation checkpointing recompute through :func:`recompute_checkpoint`.

    The segments DeepSpeed would checkpoint stay the ones it decides with its own function (computed first).
    Returns False when the module does not checkpoint; raises ``ValueError`` for a checkpoint function other
    than DeepSpeed's.
    """
    if module.activation_checkpoint_interval <= 0:
        return False
    from deepspeed.runtime.activation_checkpointing import checkpointing

    func = module.activation_checkpoint_func
    if func is recompute_checkpoint:
        return True
    if func not in (checkpointing.checkpoint, checkpointing.non_reentrant_checkpoint):
        raise ValueError(f"activation_checkpoint_func={getattr(func, '__name__', func)!r}: ds_recycle recomputes "
                         "checkpointed segments itself (a backward split into B and W needs a recompute that "
                         "honours autograd's inputs=); build the PipelineModule with the default "
                         "activation_checkpoint_func")
    module._precompute_checkpointable_values()  # DeepSpeed's choice of segments, made with its function
    module.activation_checkpoint_func = recompute_checkpoint
    return True
