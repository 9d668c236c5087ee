"""The stage gradient is the same floating-point sum whoever is alive (any number of pipelines).

Single process: D replicas of one stage are simulated in threads, each with its own
:class:`StaggeredOptimizer`, and a fake all-reduce that adds the replicas' buffers in the group's rank order
(as a ring all-reduce's order depends on who is in the group). Per micro-batch weight gradients are random
with widely spread magnitudes, so that any change of association shows in the last bits.
"""
from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ds_recycle.engine.optimizer import StaggeredOptimizer

D, M = 3, 4


@pytest.fixture(scope="module", autouse=True)
def _one_process_group(tmp_path_factory: pytest.TempPathFactory) -> None:
    if not dist.is_initialized():  # StaggeredOptimizer asks for this process's rank
        dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg') / 'store'}", rank=0,
                                world_size=1)


class _Group:
    """A fake SUM all-reduce over the threads of the replicas, adding their buffers in rank order."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks
        self.buffers: dict[int, torch.Tensor] = {}
        self.barrier = threading.Barrier(len(ranks))

    def all_reduce(self, rank: int, tensor: torch.Tensor) -> None:
        self.buffers[rank] = tensor
        self.barrier.wait()
        if rank == self.ranks[0]:
            total = self.buffers[self.ranks[0]].clone()
            for r in self.ranks[1:]:
                total = total + self.buffers[r]
            self.total = total
        self.barrier.wait()
        tensor.copy_(self.total)
        self.barrier.wait()


    def all_to_all(self, rank: int, output: torch.Tensor, tensor: torch.Tensor) -> None:
        self.buffers[rank] = tensor
        self.barrier.wait()
        size = len(self.ranks)
        for j, r in enumerate(self.ranks):
            output.view(size, -1)[j] = self.buffers[r].view(size, -1)[self.ranks.index(rank)]
        self.barrier.wait()

    def all_gather(self, rank: int, outputs: list[torch.Tensor], tensor: torch.Tensor) -> None:
        self.buffers[rank] = tensor
        self.barrier.wait()
        for j, r in enumerate(self.ranks):
            outputs[j].copy_(self.buffers[r])
        self.barrier.wait()


class _Replica(StaggeredOptimizer):
    group: _Group

    def _all_reduce_stage(self, tensor: torch.Tensor) -> None:
        self.group.all_reduce(self.rank, tensor)

    def _all_to_all_stage(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        self.group.all_to_all(self.rank, output, tensor)

    def _all_gather_stage(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> None:
        self.group.all_gather(self.rank, outputs, tensor)


def _weight_grad(seed: int, d: int, i: int, like: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1000 + d * 10 + i)
    scale = torch.tensor(10.0) ** torch.randint(-4, 5, like.shape, generator=gen)
    return torch.randn(like.shape, generator=gen) * scale


def _reduced(assign: dict[tuple[int, int], int], seed: int, per_microbatch_rows: bool = True) -> list[torch.Tensor]:
    """The reduced stage gradient when micro-batch ``(d, i)`` is processed by replica ``assign[(d, i)]``.

    ``per_microbatch_rows=False``: a re-routed pipeline's micro-batches are summed per replica and the partial
    sums added by the all-reduce (the scheme this test guards against)."""
    ranks = sorted(set(assign.values()))
    rerouted = frozenset(d for (d, _), r in assign.items() if r != d)
    group, out = _Group(ranks), {}
    steppers = {}
    for r in ranks:
        torch.manual_seed(0)
        module = nn.Linear(6, 5)
        stepper = _Replica(module, torch.optim.SGD(module.parameters(), lr=0.1), stage=0, pipelines=D, transport=None,
                           dp_ranks=ranks, max_norm=0.0,
                           served=frozenset(d for (d, _), q in assign.items() if q == r),
                           stage_rerouted=bool(rerouted),
                           rerouted_pipelines=rerouted if per_microbatch_rows else frozenset(),
                           microbatches=M, rank=r)
        stepper.group = group
        for (d, i) in sorted(mb for mb, q in assign.items() if q == r):
            with stepper.accumulating_for(d, i):
                for p in module.parameters():  # autograd's accumulation into .grad
                    g = _weight_grad(seed, d, i, p)
                    p.grad = g if p.grad is None else p.grad + g
        steppers[r] = stepper

    def run(r: int) -> None:
        steppers[r].reduce(None)
        out[r] = [p.grad.clone() for p in steppers[r].params]

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(torch.equal(a, b) for r in ranks for a, b in zip(out[r], out[ranks[0]])), "replicas disagree"
    return out[ranks[0]]


FAILURE_FREE = {(d, i): d for d in range(D) for i in range(M)}
# (1, s) lost: its micro-batches split between the two peers (as the planner does); then (2, s) lost too.
ONE_LOST = {**FAILURE_FREE, (1, 0): 0, (1, 1): 2, (1, 2): 0, (1, 3): 2}
TWO_LOST = {(d, i): 0 for d in range(D) for i in range(M)}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("failed", [ONE_LOST, TWO_LOST], ids=["one-lost", "two-lost"])
def test_reduction_is_bit_identical_whoever_is_alive(seed: int, failed: dict[tuple[int, int], int]) -> None:
    expected = _reduced(FAILURE_FREE, seed)
    got = _reduced(failed, seed)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_partial_sums_of_a_split_pipeline_are_not_exact() -> None:
    """The oracle can fail: a lost pipeline's micro-batches summed per peer, then added, differ in the last bits."""
    expected = [_reduced(FAILURE_FREE, seed) for seed in range(3)]
    partial = [_reduced(ONE_LOST, seed, per_microbatch_rows=False) for seed in range(3)]
    assert any(not all(torch.equal(a, b) for a, b in zip(e, p)) for e, p in zip(expected, partial))
