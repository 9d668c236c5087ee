"""Addressable data from a batch sampler that names its data-parallel rank (Megatron-DeepSpeed's data path).

Megatron-style scripts build their loader as ``DataLoader(dataset, batch_sampler=S(total_samples,
consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size), ...)`` and resume by starting the
sampler from ``consumed_samples``. Such a sampler's batches are a function of its attributes, so a peer can make
another pipeline's: :class:`ReplayedBatches` copies the sampler as it was when the loader was handed over, sets
``data_parallel_rank`` to that pipeline and draws from the copy until the wanted position (a cursor per pipeline,
so a peer that serves a pipeline step after step draws each batch once; a position behind the cursor starts a
fresh copy). When the copy runs out it starts again, as DeepSpeed's ``RepeatingLoader`` restarts the loader.

Accepted (:func:`replayed_batches`): a torch ``DataLoader`` with such a ``batch_sampler`` (``data_parallel_rank``
and ``data_parallel_size`` attributes), ``iter()`` of one, or a ``RepeatingLoader`` around either. Assumed and not
checkable from one rank: the sampler's batches depend on nothing but its attributes (no global random state, no
file read at iteration time), and the dataset's ``__getitem__`` is deterministic.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _BaseDataLoaderIter

__all__ = ["RANK_ATTRIBUTE", "SIZE_ATTRIBUTE", "ReplayedBatches", "names_its_rank", "replayed_batches"]

RANK_ATTRIBUTE = "data_parallel_rank"
SIZE_ATTRIBUTE = "data_parallel_size"


def names_its_rank(batch_sampler: Any) -> bool:
    """Whether ``batch_sampler`` carries the data-parallel rank and size it yields for."""
    return hasattr(batch_sampler, RANK_ATTRIBUTE) and hasattr(batch_sampler, SIZE_ATTRIBUTE)


@dataclass
class _Cursor:
    sampler: Any
    batches: Iterator[Any]
    drawn: int = 0
    last: Any = None


class ReplayedBatches:
    """``micro_batch(step, pipeline, index)`` from copies of a rank-naming batch sampler (see the module docstring)."""

    def __init__(self, dataset: Any, batch_sampler: Any, collate_fn: Callable[[list[Any]], Any], micro_batches: int,
                 *, first_step: int = 0, consumed: int = 0) -> None:
        self.dataset, self.collate_fn, self.micro_batches = dataset, collate_fn, micro_batches
        self.template = copy.deepcopy(batch_sampler)
        self.first_step, self.consumed = first_step, consumed
        self.data_parallel_size = int(getattr(batch_sampler, SIZE_ATTRIBUTE))
        self.data_parallel_rank = int(getattr(batch_sampler, RANK_ATTRIBUTE))
        self._cursors: dict[int, _Cursor] = {}

    def _fresh(self, pipeline: int) -> _Cursor:
        sampler = copy.deepcopy(self.template)
        setattr(sampler, RANK_ATTRIBUTE, pipeline)
        return _Cursor(sampler, iter(sampler))

    @staticmethod
    def _draw(cursor: _Cursor) -> Any:
        try:
            return next(cursor.batches)
        except StopIteration:  # RepeatingLoader: the loader starts again
            cursor.batches = iter(cursor.sampler)
            return next(cursor.batches)

    def indices(self, step: int, pipeline: int, index: int) -> list[int]:
        """The sample indices of micro-batch ``index`` of ``pipeline`` at ``step``."""
        if not 0 <= pipeline < self.data_parallel_size:
            raise ValueError(f"pipeline {pipeline} is outside [0, {self.data_parallel_size})")
        position = self.consumed + (step - self.first_step) * self.micro_batches + index
        if position < 0:
            raise ValueError(f"step {step} precedes the first step {self.first_step} this data is addressed from")
        cursor = self._cursors.get(pipeline)
        if cursor is None or cursor.drawn > position + 1:
            cursor = self._cursors[pipeline] = self._fresh(pipeline)
        while cursor.drawn <= position:
            cursor.last = self._draw(cursor)
            cursor.drawn += 1
        return list(cursor.last)

    def micro_batch(self, step: int, pipeline: int, index: int) -> Any:
        return self.collate_fn([self.dataset[i] for i in self.indices(step, pipeline, index)])


def replayed_batches(data_iter: Any, micro_batches: int, step: int) -> ReplayedBatches | None:
    """:class:`ReplayedBatches` for ``data_iter`` if it reads a rank-naming batch sampler, else None."""
    from deepspeed.runtime.dataloader import RepeatingLoader

    inner, current = (data_iter.loader, data_iter.data_iter) if isinstance(data_iter, RepeatingLoader) else (
        data_iter, data_iter)
    if isinstance(current, _BaseDataLoaderIter):
        sampler, consumed = current._index_sampler, current._num_yielded
        dataset, collate = current._dataset, current._collate_fn
    elif isinstance(inner, DataLoader):
        sampler, consumed, dataset, collate = inner.batch_sampler, 0, inner.dataset, inner.collate_fn
    else:
        return None
    if not names_its_rank(sampler):
        return None
    return ReplayedBatches(dataset, sampler, collate, micro_batches, first_step=step, consumed=consumed)
