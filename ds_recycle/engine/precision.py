"""bf16 training: bf16 module weights, fp32 master weights stepped by the optimizer, fp32 gradient rows.

What DeepSpeed 0.19.8 does for a ``PipelineEngine`` with ``"bf16": {"enabled": true}`` (``BF16_Optimizer``):
the module's parameters are cast to bf16; each micro-batch's backward leaves a bf16 gradient on them, which is
added into a high-precision buffer and cleared; the buffers are all-reduced; the norm of those buffers over the
whole model (every stage of the pipeline, tied copies after the first skipped) clips them; the optimizer steps
fp32 master copies of the weights and the bf16 weights are overwritten with the masters rounded to bf16.

ds_recycle keeps that, with two differences that its exactness needs:

- the master weights and the optimizer state are whole on every replica (``BF16_Optimizer`` partitions them
  over the data-parallel replicas, ZeRO-1 style, but a survivor must be able to take over any replica);
- gradients are accumulated and reduced in fp32 (``data_types.grad_accum_dtype`` fp32; DeepSpeed's default at
  ZeRO stage 0 accumulates in bf16 and warns it is unsafe): each micro-batch's bf16 gradient is widened and
  added to its fp32 gradient row (:meth:`~ds_recycle.engine.optimizer.StaggeredOptimizer.accumulating_for`),
  so a re-routed micro-batch lands in the same fp32 sum wherever it ran.

:class:`MasterWeightOptimizer` wraps the torch optimizer: its parameter groups point at the fp32 masters,
its ``state_dict`` carries the masters with the optimizer state (so the rejoin and roll-forward state transfers and
checkpoints carry them), and :meth:`MasterWeightOptimizer.step` copies the masters back into the module.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["MasterWeightOptimizer"]


class MasterWeightOptimizer:
    """``optimizer`` stepping fp32 copies of the low-precision ``params`` (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
        self.optimizer = optimizer
        self.params = list(params)
        """The module's trainable (low-precision) parameters."""
        self.masters = [nn.Parameter(p.detach().float().clone(), requires_grad=p.requires_grad) for p in self.params]
        """fp32 copies, in the order of :attr:`params`; their ``.grad`` holds the reduced fp32 gradients."""
        self._master_of = {id(p): m for p, m in zip(self.params, self.masters)}
        for group in optimizer.param_groups:
            group["params"] = [self._master_of.get(id(p), p) for p in group["params"]]
        for p, m in zip(self.params, self.masters):  # an optimizer with state already: keep it, on the masters
            if p in optimizer.state:
                optimizer.state[m] = optimizer.state.pop(p)
                for key, value in optimizer.state[m].items():
                    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0:
                        optimizer.state[m][key] = value.float()

    def master_of(self, param: nn.Parameter) -> nn.Parameter:
        """The fp32 master of a module parameter (the parameter itself if it has none)."""
        return self._master_of.get(id(param), param)

    def adopt(self, param: nn.Parameter, master: torch.Tensor) -> nn.Parameter:
        """Take over a module parameter that arrived with its fp32 master's value (a layer moved here); returns the
        new master (put it in a parameter group; :meth:`reorder` then restores the module order)."""
        held = nn.Parameter(master.detach().float().clone(), requires_grad=param.requires_grad)
        self.params.append(param)
        self.masters.append(held)
        self._master_of[id(param)] = held
        return held

    def drop(self, param: nn.Parameter) -> nn.Parameter | None:
        """Forget a module parameter (its layer left this stage); returns its master (None: it had none)."""
        held = self._master_of.pop(id(param), None)
        if held is not None:
            k = next(k for k, p in enumerate(self.params) if p is param)
            del self.params[k], self.masters[k]
        return held

    def reorder(self, params: list[nn.Parameter]) -> None:
        """Keep :attr:`params` and :attr:`masters` in the order of ``params`` (the module's trainable parameters),
        as an optimizer built on the module would: the state dict lists the masters in that order."""
        self.params = [p for p in params if id(p) in self._master_of]
        self.masters = [self._master_of[id(p)] for p in self.params]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @torch.no_grad()
    def copy_to_module(self) -> None:
        """The module's weights become the masters rounded to their dtype."""
        for p, m in zip(self.params, self.masters):
            p.copy_(m)

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise NotImplementedError("MasterWeightOptimizer.step does not take a closure")
        self.optimizer.step()
        self.copy_to_module()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in (*self.params, *self.masters):
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """The torch optimizer's state and the fp32 master weights (copies)."""
        return {"optimizer": self.optimizer.state_dict(), "fp32_master_weights": [m.detach().clone()
                                                                                   for m in self.masters]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s content; the module's weights follow the restored masters.

        The masters' gradients are dropped, as a restored stage (a state transfer, a checkpoint) has none yet.
        """
        if "fp32_master_weights" not in state:
            raise ValueError("this optimizer state has no fp32 master weights: it was not saved with bf16 enabled "
                             "(load it with bf16.enabled false, or load the module only)")
        saved = state["fp32_master_weights"]
        if len(saved) != len(self.masters):
            raise ValueError(f"the saved state has {len(saved)} fp32 master weights, this stage has "
                             f"{len(self.masters)} parameters: it is another stage's or model's state")
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for m, s in zip(self.masters, saved):
                m.copy_(s)
                m.grad = None
        self.copy_to_module()

    def __repr__(self) -> str:
        return f"MasterWeightOptimizer({self.optimizer!r})"
