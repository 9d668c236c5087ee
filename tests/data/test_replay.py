"""Megatron-style batch samplers (they name their data-parallel rank): a peer replays another pipeline's batches."""
from __future__ import annotations

from itertools import islice

import pytest
import torch
from deepspeed.runtime.dataloader import RepeatingLoader
from torch.utils.data import DataLoader, TensorDataset

from ds_recycle.data.addressable import NotAddressableError, as_addressable
from ds_recycle.data.replay import ReplayedBatches
from tests.byom.samplers import SequentialSampler, ShuffledSampler

N, MBS, DP, M = 50, 2, 2, 3
DATA = TensorDataset(torch.arange(N, dtype=torch.float32).unsqueeze(1), torch.arange(N))


def _sampler(kind: str, rank: int, consumed: int = 0) -> SequentialSampler | ShuffledSampler:
    cls = SequentialSampler if kind == "sequential" else ShuffledSampler
    return cls(N, consumed, MBS, rank, DP)


def _loader_batches(kind: str, rank: int, count: int, consumed: int = 0) -> list[list[int]]:
    """What rank ``rank``'s own RepeatingLoader yields, ``count`` batches (its labels are the sample indices)."""
    loader = RepeatingLoader(DataLoader(DATA, batch_sampler=_sampler(kind, rank, consumed)))
    return [batch[1].tolist() for batch in islice(loader, count)]


@pytest.mark.parametrize("kind", ["sequential", "shuffled"])
@pytest.mark.parametrize("consumed", [0, 12])
def test_a_peer_replays_every_pipelines_stream_past_the_end(kind: str, consumed: int) -> None:
    steps = 2 * (N // (MBS * DP * M)) + 1  # past the end of the data: the loader starts again
    own = as_addressable(RepeatingLoader(DataLoader(DATA, batch_sampler=_sampler(kind, 0, consumed))), M, step=5,
                         data_parallel_size=DP, data_parallel_rank=0)
    assert isinstance(own, ReplayedBatches)
    for pipeline in range(DP):
        want = _loader_batches(kind, pipeline, steps * M, consumed)
        got = [own.micro_batch(5 + s, pipeline, i)[1].tolist() for s in range(steps) for i in range(M)]
        assert got == want
    assert own.micro_batch(6, 1, 0)[1].tolist() == _loader_batches(kind, 1, M + 1, consumed)[M], "backwards"


def test_an_iterator_read_mid_stream_continues_from_its_position() -> None:
    it = iter(DataLoader(DATA, batch_sampler=_sampler("sequential", 1)))
    drawn = [next(it) for _ in range(4)]
    data = as_addressable(it, M, step=10, data_parallel_size=DP, data_parallel_rank=1)
    assert data.micro_batch(10, 1, 0)[1].tolist() == next(it)[1].tolist() and len(drawn) == 4
    assert data.micro_batch(10, 0, 0)[1].tolist() == _loader_batches("sequential", 0, 5)[4]


def test_a_sampler_for_another_job_shape_is_refused() -> None:
    with pytest.raises(NotAddressableError, match="data_parallel_size is 2, but this worker's is 4"):
        as_addressable(DataLoader(DATA, batch_sampler=_sampler("sequential", 0)), M, data_parallel_size=4)
    with pytest.raises(NotAddressableError, match="data_parallel_rank is 0, but this worker's is 1"):
        as_addressable(DataLoader(DATA, batch_sampler=_sampler("sequential", 0)), M, data_parallel_rank=1)


def test_a_fresh_iterator_per_step_reads_its_epochs_first_batches() -> None:
    """A loop that passes ``iter(loader)`` anew at each step reads the same first micro-batches each time, as
    DeepSpeed does; the peer's copy for another pipeline does too."""
    from torch.utils.data.distributed import DistributedSampler

    loaders = [DataLoader(DATA, batch_size=MBS, sampler=DistributedSampler(DATA, num_replicas=DP, rank=d,
                                                                           shuffle=False)) for d in range(DP)]
    for step in (0, 7):
        data = as_addressable(iter(loaders[0]), M, step=step, data_parallel_size=DP, data_parallel_rank=0)
        for d in range(DP):
            want = [b[1].tolist() for b in islice(iter(loaders[d]), M)]
            assert [data.micro_batch(step, d, i)[1].tolist() for i in range(M)] == want
