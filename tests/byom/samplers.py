"""Batch samplers built the way Megatron-DeepSpeed's pretraining scripts build theirs: from ``(total_samples,
consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)``, resuming from a sample count.

- :class:`SequentialSampler`: global batches of ``micro_batch_size * data_parallel_size`` consecutive samples from
  ``consumed_samples`` on; rank ``d`` takes slice ``d`` of each;
- :class:`ShuffledSampler`: per epoch, each rank's contiguous bucket of the epoch's samples in a permutation seeded
  by ``seed + epoch`` (the epoch comes from ``consumed_samples``), micro-batches drawn from the bucket in order.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

__all__ = ["SequentialSampler", "ShuffledSampler"]


class SequentialSampler:
    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int, drop_last: bool = True) -> None:
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} outside [0, {data_parallel_size})")
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.drop_last = micro_batch_size, drop_last
        self.data_parallel_rank, self.data_parallel_size = data_parallel_rank, data_parallel_size

    def __len__(self) -> int:
        return self.total_samples // (self.micro_batch_size * self.data_parallel_size)

    def __iter__(self) -> Iterator[list[int]]:
        width = self.micro_batch_size * self.data_parallel_size
        start = self.data_parallel_rank * self.micro_batch_size
        batch: list[int] = []
        for index in range(self.consumed_samples, self.total_samples):
            batch.append(index)
            if len(batch) == width:
                yield batch[start:start + self.micro_batch_size]
                batch = []
        if batch and not self.drop_last and len(batch) > start:
            yield batch[start:start + self.micro_batch_size]


class ShuffledSampler:
    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int, seed: int = 1234) -> None:
        self.total_samples, self.consumed_samples, self.seed = total_samples, consumed_samples, seed
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank, self.data_parallel_size = data_parallel_rank, data_parallel_size

    def __len__(self) -> int:
        return self.total_samples // (self.micro_batch_size * self.data_parallel_size)

    def __iter__(self) -> Iterator[list[int]]:
        width = self.micro_batch_size * self.data_parallel_size
        active = self.total_samples - self.total_samples % width
        epoch, offset = divmod(self.consumed_samples, active)
        bucket = active // self.data_parallel_size
        generator = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(bucket, generator=generator).tolist()
        base = self.data_parallel_rank * bucket
        start = offset // self.data_parallel_size
        for i in range(start, bucket - self.micro_batch_size + 1, self.micro_batch_size):
            yield [base + j for j in order[i:i + self.micro_batch_size]]
