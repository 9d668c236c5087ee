"""bf16 master weights: fp32 copies stepped by the optimizer, carried by its state dict (snapshots, rejoin, checkpoints)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ds_recycle.engine.optimizer import StaggeredOptimizer
from ds_recycle.engine.precision import MasterWeightOptimizer


def _bf16_stage() -> tuple[nn.Module, MasterWeightOptimizer]:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 2)).to(torch.bfloat16)
    params = list(module.parameters())
    return module, MasterWeightOptimizer(torch.optim.Adam(params, lr=1e-2), params)


def _stepper(module: nn.Module, optimizer: MasterWeightOptimizer) -> StaggeredOptimizer:
    return StaggeredOptimizer(module, optimizer, stage=0, pipelines=1, transport=None, dp_ranks=[0],
                              max_norm=0.0, served=frozenset({0}), rank=0)


def _micro_batch(module: nn.Module, stepper: StaggeredOptimizer, seed: int) -> None:
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    with stepper.accumulating_for(0, seed):
        module(x).float().pow(2).mean().backward()


def test_micro_batch_gradients_accumulate_in_fp32_and_the_step_moves_the_masters() -> None:
    module, optimizer = _bf16_stage()
    stepper = _stepper(module, optimizer)
    assert all(m.dtype == torch.float32 for group in optimizer.param_groups for m in group["params"])
    for seed in range(3):
        _micro_batch(module, stepper, seed)
    assert all(p.grad is None for p in module.parameters()), "each micro-batch's bf16 gradient is folded and cleared"
    want = []
    for p in module.parameters():  # the three micro-batches' bf16 gradients, added in fp32
        total = None
        for seed in range(3):
            x = torch.randn(3, 6, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
            module.zero_grad(set_to_none=True)
            module(x).float().pow(2).mean().backward()
            wide = next(q for q in module.parameters() if q is p).grad.float()
            total = wide if total is None else total + wide
        want.append(total)
    module.zero_grad(set_to_none=True)
    got = [h.grad for h in stepper.holders]
    assert all(g is not None and g.dtype == torch.float32 and torch.equal(g, w) for g, w in zip(got, want))
    before = [m.detach().clone() for m in optimizer.masters]
    stepper.reduce(None)
    stepper.step(0, synchronous=True)
    stepper.finish()
    for p, m, b in zip(module.parameters(), optimizer.masters, before):
        assert not torch.equal(m, b)
        assert p.dtype == torch.bfloat16 and torch.equal(p, m.to(torch.bfloat16))  # weights are the rounded masters


def test_the_state_dict_carries_the_fp32_masters_not_just_the_bf16_weights() -> None:
    """Snapshots, the rejoin state transfer and checkpoints all move a stage's ``optimizer.state_dict()``."""
    module, optimizer = _bf16_stage()
    joiner_module, joiner = _bf16_stage()
    stepper = _stepper(module, optimizer)
    for k in range(4):
        _micro_batch(module, stepper, k)
        stepper.reduce(None)
        stepper.step(k, synchronous=True)
        stepper.finish()
    moved = [m.detach().clone() for m in optimizer.masters]
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in moved), "masters hold more than bf16 bits"
    state = copy.deepcopy(optimizer.state_dict())
    joiner.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(joiner.masters, moved))
    assert all(torch.equal(a, b) for a, b in zip(joiner_module.parameters(), module.parameters()))
    assert joiner.state_dict()["optimizer"]["state"].keys() == {0, 1, 2, 3}
    _micro_batch(module, stepper, 9)  # an interrupted iteration's gradients: a restore drops them
    assert all(h.grad is not None for h in stepper.holders)
    optimizer.load_state_dict(state)
    assert all(h.grad is None for h in stepper.holders)


def test_a_state_without_masters_is_refused() -> None:
    _, optimizer = _bf16_stage()
    with pytest.raises(ValueError, match="no fp32 master weights"):
        optimizer.load_state_dict(torch.optim.Adam([nn.Parameter(torch.zeros(1))]).state_dict())



def test_a_moved_layers_masters_are_adopted_dropped_and_kept_in_module_order() -> None:
    a, b, c = (nn.Parameter(torch.full((2,), float(k), dtype=torch.bfloat16)) for k in range(3))
    opt = MasterWeightOptimizer(torch.optim.SGD([a, c], lr=0.1), [a, c])
    exact = torch.tensor([1.0009765625, 1.5], dtype=torch.float32)  # not a bf16 value: the master keeps its bits
    master = opt.adopt(b, exact)
    assert master.dtype == torch.float32 and torch.equal(master, exact) and opt.master_of(b) is master
    opt.reorder([a, b, c])
    assert opt.params == [a, b, c] and [m.data_ptr() for m in opt.masters] == [
        opt.master_of(p).data_ptr() for p in (a, b, c)]
    assert opt.drop(a) is not None and opt.drop(a) is None
    assert opt.params == [b, c] and len(opt.masters) == 2 and opt.master_of(a) is a
