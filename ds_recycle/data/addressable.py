"""Addressable training data: any worker can produce micro-batch ``index`` of pipeline ``pipeline`` at ``step``.

ReCycle re-routes a failed pipeline's micro-batches to a live peer of the same stage. When that stage
loads data (the first stage reads inputs, the last stage reads labels), the peer must produce the failed
pipeline's micro-batch itself, so the data has to be a pure function of ``(step, pipeline, index)``:

- :class:`AddressableData` is the contract: one method, ``micro_batch(step, pipeline, index)``, returning
  the batch exactly as the pipeline's own loader would yield it (usually ``(inputs, labels)``).
- :class:`DeepSpeedOrder` implements it for ``deepspeed.initialize(training_data=dataset)``: micro-batch
  ``index`` of pipeline ``d`` at step ``t`` is the ``(t*M + index)``-th batch that vanilla DeepSpeed 0.19.8's
  loader on data-parallel rank ``d`` yields (the same ``DistributedSampler`` split, padding, batching,
  partial last batch and epochs), computed by arithmetic, never by replaying the loader.
- :meth:`DeepSpeedOrder.from_data_iter` reads the same order off a torch ``DataLoader`` with a
  ``DistributedSampler`` (bare, ``iter()`` of it, or in a DeepSpeed ``RepeatingLoader``) that a user passes
  as ``train_batch(data_iter=...)``; :func:`as_addressable` also takes any object with the hook.
  Anything else raises :class:`NotAddressableError`, whose message says what to pass instead.

Resuming: the stream is a pure function of the step, so a run resumed at step ``t`` asks for step ``t``
and continues where it stopped (vanilla DeepSpeed restarts its loader at the first batch instead). The
checkpoint needs the global step, which DeepSpeed already saves, and :meth:`DeepSpeedOrder.state_dict`
to check at load time that the order has not changed (:meth:`DeepSpeedOrder.check_state`).

Example::

    order = DeepSpeedOrder.from_config(dataset, ds_config, data_parallel_size=D, collate_fn=collate)
    inputs, labels = order.micro_batch(step=12, pipeline=1, index=3)
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from inspect import GEN_CREATED, getgeneratorstate
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset
from torch.utils.data.dataloader import _BaseDataLoaderIter, _DatasetKind, default_collate
from torch.utils.data.distributed import DistributedSampler

from ds_recycle.config.job import batch_sizes

__all__ = ["AddressableData", "DeepSpeedOrder", "NotAddressableError", "as_addressable", "resolve_batch_sizes"]

logger = logging.getLogger(__name__)

Collate = Callable[[list[Any]], Any]

_REMEDY = (
    "ReCycle re-routes a failed pipeline's micro-batches to a live peer, which must then load micro-batch "
    "`index` of that pipeline at step `step` itself, so the data must be addressable by (step, pipeline, index). "
    "Pass the map-style Dataset as `training_data=` (DeepSpeed's own order is reproduced), a torch DataLoader "
    "whose sampler is a DistributedSampler (fresh, `iter()` of one, or a deepspeed RepeatingLoader around one), "
    "a DataLoader whose batch_sampler names its data_parallel_rank and data_parallel_size (Megatron-style), "
    "or an object with a `micro_batch(step, pipeline, index)` method."
)


class NotAddressableError(ValueError):
    """The training data cannot be addressed by ``(step, pipeline, index)``; the message says why and what to do."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"{reason}. {_REMEDY}")
        self.reason = reason


@runtime_checkable
class AddressableData(Protocol):
    """Training data any worker can serve for any pipeline: the hook re-routing relies on."""

    def micro_batch(self, step: int, pipeline: int, index: int) -> Any:
        """Micro-batch ``index`` (``0 <= index < M``) of pipeline ``pipeline`` at training step ``step``.

        A pure function of its arguments, equal to what the pipeline's own loader yields there (usually
        ``(inputs, labels)``, either a tensor or a tuple of tensors)."""
        ...


@dataclass(frozen=True)
class DeepSpeedOrder:
    """The batches DeepSpeed's pipeline loader yields, on every data-parallel rank, by random access.

    In DeepSpeed 0.19.8 ``PipelineEngine._build_data_iter`` (``runtime/pipe/engine.py:259-267``) builds, on
    data-parallel rank ``d`` of ``D``, ``DistributedSampler(dataset, num_replicas=D, rank=d, shuffle=False)``
    (seed 0, ``drop_last=False``, ``set_epoch`` never called anywhere in DeepSpeed), hands it to
    ``deepspeed_io`` (``runtime/engine.py:2823-2881``): a ``DeepSpeedDataLoader`` with ``batch_size`` =
    ``train_micro_batch_size_per_gpu``, the engine's ``collate_fn`` (torch's default collate when ``None``)
    and ``drop_last`` = the config's ``dataloader_drop_last``, and wraps it in a ``RepeatingLoader``
    (``runtime/dataloader.py:17-38``), which starts a new epoch on ``StopIteration``. Each epoch builds a new
    torch ``DataLoader`` over the same sampler (``dataloader.py:108-157``), so with ``shuffle=False`` (or any
    fixed sampler epoch) every epoch yields the same batches. The ``train_batch`` of step ``t`` draws ``M``
    (gradient accumulation steps) batches, so micro-batch ``index`` is batch ``t*M + index`` of the stream.

    ``pipeline`` is the data-parallel rank (``engine.grid.get_data_parallel_rank()``). Not reproduced, as
    they change no value: pinned memory (``pin_memory=True`` on an accelerator), and the seed torch's
    ``DataLoader`` draws from the global CPU generator at every epoch start (torch 2.13
    ``utils/data/dataloader.py:690``), which shifts a vanilla first or last stage's global RNG stream.

    Fields beyond the first six describe other ``DistributedSampler`` loaders (see :meth:`from_data_iter`):
    ``shuffle``/``seed``/``sampler_epoch``/``sampler_drop_last`` are the sampler's, ``repeat`` says whether a
    new epoch follows the last batch (``False``: one epoch, as ``iter(DataLoader)``), and at step
    ``first_step`` each rank's loader had already yielded ``consumed`` batches.
    """

    dataset: Dataset[Any]
    micro_batch_size: int
    data_parallel_size: int
    micro_batches: int
    collate_fn: Collate = default_collate
    drop_last: bool = False
    shuffle: bool = False
    seed: int = 0
    sampler_epoch: int = 0
    sampler_drop_last: bool = False
    repeat: bool = True
    first_step: int = 0
    consumed: int = 0
    _permutation: dict[int, list[int]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "data_parallel_size", "micro_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"DeepSpeedOrder: {name}={getattr(self, name)} must be at least 1")
        if isinstance(self.dataset, IterableDataset) or not hasattr(self.dataset, "__len__"):
            raise NotAddressableError(f"{type(self.dataset).__name__} is not a map-style Dataset (no __len__, "
                                      "or an IterableDataset): its samples cannot be reached by index")
        if self.batches_per_epoch < 1:
            raise ValueError(
                f"each data-parallel rank's loader yields no batch: {len(self)} samples over "
                f"{self.data_parallel_size} ranks give {self.samples_per_replica} per rank, fewer than "
                f"micro_batch_size={self.micro_batch_size} with drop_last (or none at all); vanilla "
                "DeepSpeed raises StopIteration at its first step. Use a larger dataset, a smaller micro-batch "
                "or drop_last=False")
        if self.consumed < 0 or (not self.repeat and self.consumed > self.batches_per_epoch):
            raise ValueError(f"consumed={self.consumed} batches is outside the stream of "
                             f"{self.batches_per_epoch} batches (repeat={self.repeat})")

    # ---- construction -------------------------------------------------------------------------------

    @classmethod
    def from_config(cls, dataset: Dataset[Any], config: Mapping[str, Any], data_parallel_size: int,
                    collate_fn: Collate | None = None) -> DeepSpeedOrder:
        """The order ``deepspeed.initialize(config=config, training_data=dataset, collate_fn=collate_fn)``
        gives a ``PipelineEngine`` with ``data_parallel_size`` pipelines."""
        _refuse_data_sampling(config)
        micro_batch_size, micro_batches = resolve_batch_sizes(config, data_parallel_size)
        return cls(dataset, micro_batch_size, data_parallel_size, micro_batches,
                   collate_fn=collate_fn if collate_fn is not None else default_collate,
                   drop_last=bool(config.get("dataloader_drop_last", False)))

    @classmethod
    def from_engine(cls, engine: Any) -> DeepSpeedOrder:
        """The order of a built ``PipelineEngine``'s own ``training_data=`` loader, from the engine's settings
        (``training_data``, ``collate_fn``: ``runtime/engine.py:531-532``; the grid's data-parallel size)."""
        if engine.training_data is None:
            raise NotAddressableError("the engine was built without `training_data=`, so it has no loader of its "
                                      "own to reproduce")
        if engine.curriculum_learning_enabled():
            raise NotAddressableError("the engine samples by curriculum (DeepSpeedDataSampler), whose order "
                                      "depends on training progress")
        return cls(engine.training_data, engine.train_micro_batch_size_per_gpu(), engine.grid.data_parallel_size,
                   engine.micro_batches,
                   collate_fn=engine.collate_fn if engine.collate_fn is not None else default_collate,
                   drop_last=bool(engine.dataloader_drop_last()))

    @classmethod
    def from_data_iter(cls, data_iter: Any, micro_batches: int, *, step: int = 0,
                       data_parallel_size: int | None = None,
                       data_parallel_rank: int | None = None) -> DeepSpeedOrder:
        """The order of ``train_batch(data_iter=data_iter)`` calls, the first of which is at ``step``.

        Accepted: a torch ``DataLoader`` (read as ``RepeatingLoader(loader)`` would serve it), ``iter()`` of
        one (one epoch, from its current position), a DeepSpeed ``RepeatingLoader`` around either a
        ``DataLoader`` (any position) or a ``DeepSpeedDataLoader`` (not yet drawn from), or a bare
        ``DeepSpeedDataLoader`` being iterated (not yet drawn from). The loader must be map-style with
        automatic batching and a torch ``BatchSampler`` over a ``DistributedSampler`` of the same dataset.

        Assumed, and not checkable from one rank: every other data-parallel rank ``d`` passes the same
        loader built with ``rank=d``, at the same position; the sampler's ``epoch`` now is the one every
        epoch of the stream uses (``RepeatingLoader`` never calls ``set_epoch``; a loop that calls it per
        epoch passes a fresh iterator per epoch and builds a new order for it); the dataset's ``__getitem__``
        is deterministic. ``data_parallel_size`` / ``data_parallel_rank``, when given, are checked against
        the sampler's ``num_replicas`` / ``rank``.
        """
        view = _read_loader(data_iter)
        sampler = view.sampler
        if data_parallel_size is not None and sampler.num_replicas != data_parallel_size:
            raise NotAddressableError(
                f"the DistributedSampler splits the data over num_replicas={sampler.num_replicas} ranks but the "
                f"job has {data_parallel_size} pipelines; build it with num_replicas={data_parallel_size}")
        if data_parallel_rank is not None and sampler.rank != data_parallel_rank:
            raise NotAddressableError(
                f"the DistributedSampler has rank={sampler.rank} but this worker is pipeline "
                f"{data_parallel_rank}; build it with the data-parallel rank (engine.grid.data_parallel_id)")
        order = cls(view.dataset, view.batch_size, sampler.num_replicas, micro_batches,
                    collate_fn=view.collate_fn, drop_last=view.drop_last, shuffle=sampler.shuffle,
                    seed=sampler.seed, sampler_epoch=sampler.epoch, sampler_drop_last=sampler.drop_last,
                    repeat=view.repeat, first_step=step, consumed=view.consumed)
        logger.info("addressable data from %s: %s", type(data_iter).__name__, order.state_dict())
        return order

    # ---- the shape of the stream --------------------------------------------------------------------

    def __len__(self) -> int:
        """Samples in the dataset."""
        return len(self.dataset)  # type: ignore[arg-type]

    @property
    def samples_per_replica(self) -> int:
        """Samples one rank's ``DistributedSampler`` yields per epoch (its ``num_samples``)."""
        n, d = len(self), self.data_parallel_size
        if self.sampler_drop_last and n % d:
            return math.ceil((n - d) / d)
        return math.ceil(n / d)

    @property
    def batches_per_epoch(self) -> int:
        """Batches one rank's loader yields per epoch (``len(loader)``)."""
        if self.drop_last:
            return self.samples_per_replica // self.micro_batch_size
        return math.ceil(self.samples_per_replica / self.micro_batch_size)

    def locate(self, step: int, index: int) -> tuple[int, int]:
        """``(epoch, batch)``: micro-batch ``index`` of ``step`` is batch ``batch`` of the loader's epoch
        ``epoch`` (counted from the loader's first epoch; the same on every rank)."""
        if step < self.first_step:
            raise ValueError(f"step {step} precedes the first step {self.first_step} this data is addressed from")
        if not 0 <= index < self.micro_batches:
            raise ValueError(f"micro-batch index {index} is outside [0, {self.micro_batches})")
        epoch, batch = divmod(self.consumed + (step - self.first_step) * self.micro_batches + index,
                              self.batches_per_epoch)
        if epoch and not self.repeat:
            raise IndexError(f"micro-batch {index} of step {step} lies past the end of the single epoch "
                             f"({self.batches_per_epoch} batches) of a non-repeating loader: a vanilla run's "
                             "next() raises StopIteration here")
        return epoch, batch

    def sample_indices(self, step: int, pipeline: int, index: int) -> list[int]:
        """Dataset indices of micro-batch ``index`` of pipeline ``pipeline`` at ``step``, in batch order."""
        if not 0 <= pipeline < self.data_parallel_size:
            raise ValueError(f"pipeline {pipeline} is outside [0, {self.data_parallel_size})")
        _, batch = self.locate(step, index)
        first = batch * self.micro_batch_size
        last = min(first + self.micro_batch_size, self.samples_per_replica)
        # The sampler pads its index list by cycling it (or truncates it with drop_last): position p of the
        # padded list holds base[p % n]; rank `pipeline` takes positions pipeline, pipeline + D, ...
        n, d = len(self), self.data_parallel_size
        positions = [(pipeline + d * j) % n for j in range(first, last)]
        if not self.shuffle:
            return positions
        base = self._shuffled()
        return [base[p] for p in positions]

    # ---- the contract -------------------------------------------------------------------------------

    def micro_batch(self, step: int, pipeline: int, index: int) -> Any:
        """The batch, collated as the loader collates it (``__getitems__`` when the dataset has one)."""
        indices = self.sample_indices(step, pipeline, index)
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(indices) if getitems else [self.dataset[i] for i in indices]
        return self.collate_fn(samples)

    def iteration(self, step: int, pipeline: int) -> Iterator[Any]:
        """The ``M`` micro-batches pipeline ``pipeline`` trains on at ``step``, in order."""
        return (self.micro_batch(step, pipeline, i) for i in range(self.micro_batches))

    def stream(self, pipeline: int, step: int | None = None) -> Iterator[Any]:
        """What pipeline ``pipeline``'s data iterator yields from ``step`` on (default: the first step);
        usable as ``train_batch(data_iter=...)`` in a vanilla engine."""
        t = self.first_step if step is None else step
        while True:
            yield from self.iteration(t, pipeline)
            t += 1

    # ---- checkpoints ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int | bool]:
        """What defines the order (not the samples): save it with a checkpoint and pass it to
        :meth:`check_state` on resume; with the saved global step it pins the stream down."""
        return {"samples": len(self), "micro_batch_size": self.micro_batch_size,
                "data_parallel_size": self.data_parallel_size, "micro_batches": self.micro_batches,
                "drop_last": self.drop_last, "shuffle": self.shuffle, "seed": self.seed,
                "sampler_epoch": self.sampler_epoch, "sampler_drop_last": self.sampler_drop_last,
                "repeat": self.repeat, "first_step": self.first_step, "consumed": self.consumed}

    def check_state(self, state: Mapping[str, int | bool]) -> None:
        """Raise ``ValueError`` naming every field where ``state`` (a saved :meth:`state_dict`) differs."""
        mine = self.state_dict()
        diff = [f"{k}: saved {state.get(k)!r}, now {v!r}" for k, v in mine.items() if state.get(k) != v]
        if diff:
            raise ValueError("the data order differs from the checkpoint's, so resuming would not continue "
                             "its stream (" + "; ".join(diff) + "); restore the saved dataset, batch sizes "
                             "and data-parallel size, or start a new run")

    # ---- helpers --------------------------------------------------------------------------------------

    def _shuffled(self) -> list[int]:
        """The sampler's permutation (``randperm`` seeded by ``seed + epoch``), computed once."""
        key = self.seed + self.sampler_epoch
        if key not in self._permutation:
            generator = torch.Generator()
            generator.manual_seed(key)
            self._permutation.clear()
            self._permutation[key] = torch.randperm(len(self), generator=generator).tolist()
        return self._permutation[key]


def as_addressable(data: Any, micro_batches: int, *, step: int = 0, data_parallel_size: int | None = None,
                   data_parallel_rank: int | None = None) -> AddressableData:
    """``data`` itself when it has the ``micro_batch`` hook; a loader over a batch sampler that names its
    data-parallel rank (Megatron-style: :mod:`ds_recycle.data.replay`); else :meth:`DeepSpeedOrder.from_data_iter`."""
    if callable(getattr(data, "micro_batch", None)):
        return data
    from ds_recycle.data.replay import replayed_batches

    replayed = replayed_batches(data, micro_batches, step)
    if replayed is not None:
        for name, want, have in (("data_parallel_size", data_parallel_size, replayed.data_parallel_size),
                                 ("data_parallel_rank", data_parallel_rank, replayed.data_parallel_rank)):
            if want is not None and want != have:
                raise NotAddressableError(f"the batch sampler's {name} is {have}, but this worker's is {want}; "
                                          f"build it with {name}={want} (engine.grid)")
        return replayed
    return DeepSpeedOrder.from_data_iter(data, micro_batches, step=step, data_parallel_size=data_parallel_size,
                                         data_parallel_rank=data_parallel_rank)


def resolve_batch_sizes(config: Mapping[str, Any], data_parallel_size: int) -> tuple[int, int]:
    """``(train_micro_batch_size_per_gpu, gradient_accumulation_steps)`` as DeepSpeed resolves them
    (:func:`ds_recycle.config.job.batch_sizes`)."""
    return batch_sizes(config, data_parallel_size)


def _refuse_data_sampling(config: Mapping[str, Any]) -> None:
    """DeepSpeed's curriculum sampler (``data_efficiency.data_sampling.curriculum_learning``) replaces the
    DistributedSampler with one whose order follows training progress: not reproduced here."""
    sampling = config.get("data_efficiency", {}).get("data_sampling", {})
    if sampling.get("curriculum_learning", {}).get("enabled", False):
        raise NotAddressableError("the config enables data_efficiency.data_sampling.curriculum_learning, whose "
                                  "DeepSpeedDataSampler orders data by training progress; disable it")


# ---- reading a user's loader --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _LoaderView:
    """What a ``DistributedSampler`` loader's order depends on, and how far it has been read."""

    dataset: Dataset[Any]
    sampler: DistributedSampler[Any]
    batch_size: int
    drop_last: bool
    collate_fn: Collate
    repeat: bool
    consumed: int


def _read_loader(obj: Any) -> _LoaderView:
    """Unwrap ``obj`` (see :meth:`DeepSpeedOrder.from_data_iter`) or raise :class:`NotAddressableError`."""
    from deepspeed.runtime.dataloader import DeepSpeedDataLoader, RepeatingLoader

    if isinstance(obj, RepeatingLoader):
        inner, current = obj.loader, obj.data_iter
        if isinstance(inner, DataLoader) and isinstance(current, _BaseDataLoaderIter):
            return _view_of_iterator(current, repeat=True)
        if isinstance(inner, DeepSpeedDataLoader) and current is inner:
            return _view_of_deepspeed_loader(inner, repeat=True)
        raise NotAddressableError(f"the RepeatingLoader wraps a {type(inner).__name__}, not a torch DataLoader "
                                  "or a DeepSpeedDataLoader")
    if isinstance(obj, DeepSpeedDataLoader):
        return _view_of_deepspeed_loader(obj, repeat=False)
    if isinstance(obj, _BaseDataLoaderIter):
        return _view_of_iterator(obj, repeat=False)
    if isinstance(obj, DataLoader):  # not iterated here: iter() would start workers and draw a seed
        return _batched_view(obj.dataset, obj._dataset_kind, obj._auto_collation, obj._index_sampler,
                             obj.collate_fn, repeat=True, consumed=0)
    raise NotAddressableError(f"a {type(obj).__name__} is not a loader whose order can be computed")


def _view_of_iterator(it: _BaseDataLoaderIter, repeat: bool) -> _LoaderView:
    """``iter()`` of a torch DataLoader, ``_num_yielded`` batches into its epoch."""
    return _batched_view(it._dataset, it._dataset_kind, it._auto_collation, it._index_sampler, it._collate_fn,
                         repeat=repeat, consumed=it._num_yielded)


def _batched_view(dataset: Any, kind: int, auto_collation: bool, batches: Any, collate: Collate, repeat: bool,
                  consumed: int) -> _LoaderView:
    """A torch DataLoader's parts, checked: map-style, a ``BatchSampler`` over a ``DistributedSampler``."""
    if kind != _DatasetKind.Map or not auto_collation:
        raise NotAddressableError("the DataLoader iterates an IterableDataset or has batch_size=None, so its "
                                  "batches are not index batches of a DistributedSampler")
    if type(batches) is not BatchSampler:
        raise NotAddressableError(f"the DataLoader's batch_sampler is a {type(batches).__name__}, not torch's "
                                  "BatchSampler (a custom batch sampler's order cannot be computed)")
    sampler = _distributed_sampler(batches.sampler, dataset)
    return _LoaderView(dataset, sampler, batches.batch_size, batches.drop_last, collate, repeat, consumed)


def _view_of_deepspeed_loader(loader: Any, repeat: bool) -> _LoaderView:
    """A ``DeepSpeedDataLoader`` that has not yielded a batch yet (its position is not readable later)."""
    if loader.curriculum_learning_enabled:
        raise NotAddressableError("the DeepSpeedDataLoader samples by curriculum (DeepSpeedDataSampler), whose "
                                  "order depends on training progress")
    if loader.data is None or getgeneratorstate(loader.data) != GEN_CREATED:
        raise NotAddressableError("the DeepSpeedDataLoader has been iterated before (or never), so its position "
                                  "is unknown; pass it before the first batch is drawn, or its dataset as "
                                  "`training_data=`")
    sampler = _distributed_sampler(loader.data_sampler, loader.dataset)
    collate = loader.collate_fn if loader.collate_fn is not None else default_collate
    return _LoaderView(loader.dataset, sampler, loader.batch_size, loader.dataloader_drop_last, collate, repeat, 0)


def _distributed_sampler(sampler: Any, dataset: Any) -> DistributedSampler[Any]:
    """``sampler`` if it orders samples exactly as torch's ``DistributedSampler`` does, over ``dataset``."""
    if not isinstance(sampler, DistributedSampler):
        raise NotAddressableError(f"the loader's sampler is a {type(sampler).__name__}, not a DistributedSampler "
                                  "(which names the data-parallel rank whose share it yields)")
    overridden = [m for m in ("__iter__", "__len__") if getattr(type(sampler), m) is not getattr(DistributedSampler, m)]
    if overridden:
        raise NotAddressableError(f"{type(sampler).__name__} overrides DistributedSampler.{'/'.join(overridden)}, "
                                  "so its order cannot be computed")
    if sampler.dataset is not dataset:
        raise NotAddressableError("the DistributedSampler was built over another dataset object than the "
                                  "DataLoader's; build both from the same dataset")
    return sampler
