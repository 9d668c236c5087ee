"""Addressable data equals, batch for batch and bit for bit, what DeepSpeed's own loaders yield.

The oracle is DeepSpeed 0.19.8's own objects, built the way ``PipelineEngine._build_data_iter`` builds them
on data-parallel rank ``d`` (a ``DistributedSampler(shuffle=False)``, a ``DeepSpeedDataLoader``, a
``RepeatingLoader``), with explicit ``num_replicas``/``rank`` and no process group.
"""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from deepspeed.runtime import config as ds_config_module
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.dataloader import DeepSpeedDataLoader, RepeatingLoader
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from spawn import spawn  # noqa: E402

from ds_recycle.data import AddressableData, DeepSpeedOrder, NotAddressableError, as_addressable
from ds_recycle.data.addressable import resolve_batch_sizes

# DeepSpeed's loader asks for pinned memory, which torch turns down on a machine without an accelerator.
pytestmark = pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")


class Pairs(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``(inputs, label)``: a float vector that identifies the sample and an int label; counts its reads."""

    def __init__(self, n: int) -> None:
        self.n, self.reads = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads += 1
        return torch.tensor([i, i * 0.5, -i], dtype=torch.float32), torch.tensor(i % 3)


class Records(Dataset[dict[str, Any]]):
    """Dict samples; with ``batched`` it has ``__getitems__`` (the DataLoader then reads a whole batch at once)."""

    def __init__(self, n: int, batched: bool = False) -> None:
        self.n = n
        if batched:
            self.__getitems__ = self._getitems

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(i)
        return {"tokens": torch.randint(0, 100, (5,), generator=g), "mask": torch.rand(5, generator=g) > 0.5,
                "target": torch.randn(2, generator=g), "id": i}

    def _getitems(self, indices: list[int]) -> list[dict[str, Any]]:
        return [{**self[i], "via": "getitems"} for i in indices]


def tuple_collate(samples: list[dict[str, Any]]) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[Any, ...]]:
    """A user collate: ``((tokens, mask), (target, ids))``, tuples of tensors on both sides."""
    tokens = torch.stack([s["tokens"] for s in samples])
    mask = torch.stack([s["mask"] for s in samples])
    target = torch.stack([s["target"] for s in samples])
    ids = torch.tensor([s["id"] for s in samples])
    return (tokens, mask), (target, ids)


def assert_same(a: Any, b: Any, where: object = "") -> None:
    """Equal structure, types, dtypes, shapes and values (bit for bit)."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (where, a, b)
        assert torch.equal(a, b), (where, a, b)
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), (where, a, b)
        for x, y in zip(a, b):
            assert_same(x, y, where)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (where, a, b)
        for k in a:
            assert_same(a[k], b[k], where)
    else:
        assert a == b, (where, a, b)


def deepspeed_stream(dataset: Dataset[Any], mbs: int, dp: int, rank: int, collate: Callable[..., Any] | None,
                     drop_last: bool, workers: int | None = 0) -> Iterator[Any]:
    """Rank ``rank``'s data iterator exactly as ``PipelineEngine._build_data_iter`` makes it.

    ``workers=None`` keeps DeepSpeed's default (2 loader processes per epoch); 0 loads in-process (the same
    batches, faster on this machine)."""
    sampler = DistributedSampler(dataset, num_replicas=dp, rank=rank, shuffle=False)
    loader = DeepSpeedDataLoader(dataset, batch_size=mbs, pin_memory=True, local_rank=0, tput_timer=None,
                                 collate_fn=collate, num_local_io_workers=workers, data_sampler=sampler,
                                 data_parallel_world_size=dp, data_parallel_rank=rank,
                                 dataloader_drop_last=drop_last)
    return iter(RepeatingLoader(loader))


def assert_order_matches(order: AddressableData, streams: list[Iterator[Any]], steps: int, micro_batches: int,
                         first_step: int = 0) -> None:
    for t in range(first_step, first_step + steps):
        for d, stream in enumerate(streams):
            for i in range(micro_batches):
                assert_same(order.micro_batch(t, d, i), next(stream), (t, d, i))


# (samples, D, micro-batch size, M, dataloader_drop_last): divisible by D*mbs or not, padding of the sampler
# (N % D != 0, and N < D where the padding repeats the list more than once), a partial last batch kept or
# dropped, one batch per epoch, and M not dividing the epoch (steps straddle epochs).
GRID = [
    (24, 2, 3, 2, False),
    (25, 2, 3, 2, False),
    (25, 2, 3, 2, True),
    (10, 3, 4, 3, False),
    (10, 3, 4, 3, True),
    (7, 4, 2, 1, False),
    (2, 5, 1, 2, False),
    (50, 2, 4, 3, True),
]


def steps_for(order: DeepSpeedOrder, epochs: int = 3) -> int:
    """Enough steps to cover ``epochs`` full epochs and start one more."""
    return (epochs * order.batches_per_epoch) // order.micro_batches + 2


@pytest.mark.parametrize("n,dp,mbs,m,drop_last", GRID)
def test_training_data_order_equals_deepspeed_loader(n: int, dp: int, mbs: int, m: int, drop_last: bool) -> None:
    dataset = Pairs(n)
    order = DeepSpeedOrder(dataset, mbs, dp, m, drop_last=drop_last)
    streams = [deepspeed_stream(dataset, mbs, dp, d, None, drop_last) for d in range(dp)]
    assert order.batches_per_epoch == len(streams[0].loader)  # type: ignore[attr-defined]
    assert_order_matches(order, streams, steps_for(order), m)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("batched", [False, True])
def test_custom_collate_with_tuples_of_tensors(drop_last: bool, batched: bool) -> None:
    dataset = Records(23, batched=batched)
    order = DeepSpeedOrder(dataset, 4, 2, 2, collate_fn=tuple_collate, drop_last=drop_last)
    streams = [deepspeed_stream(dataset, 4, 2, d, tuple_collate, drop_last) for d in range(2)]
    assert_order_matches(order, streams, steps_for(order), 2)


def test_default_collate_of_dict_samples_with_getitems() -> None:
    dataset = Records(9, batched=True)
    order = DeepSpeedOrder(dataset, 2, 2, 3)
    streams = [deepspeed_stream(dataset, 2, 2, d, None, False) for d in range(2)]
    assert_order_matches(order, streams, steps_for(order), 3)
    assert order.micro_batch(0, 0, 0)["via"] == ["getitems", "getitems"]


def test_deepspeed_default_worker_processes_yield_the_same_batches() -> None:
    dataset = Records(11)
    order = DeepSpeedOrder(dataset, 2, 2, 2, collate_fn=tuple_collate)
    streams = [deepspeed_stream(dataset, 2, 2, d, tuple_collate, False, workers=None) for d in range(2)]
    assert_order_matches(order, streams, steps_for(order), 2)


@pytest.mark.parametrize("config", [
    {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2},
    {"train_batch_size": 12, "gradient_accumulation_steps": 2, "dataloader_drop_last": True},
    {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3},
    {"train_batch_size": 6},
    {"train_micro_batch_size_per_gpu": 3, "dataloader_drop_last": True},
    {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2},
])
def test_from_config_resolves_batch_keys_as_deepspeed_does(config: dict[str, Any],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    dp = 2

    class Grid:
        def get_data_parallel_world_size(self) -> int:
            return dp

    monkeypatch.setattr(ds_config_module.dist, "get_rank", lambda: 0)
    reference = DeepSpeedConfig(dict(config), mpu=Grid())
    assert resolve_batch_sizes(config, dp) == (reference.train_micro_batch_size_per_gpu,
                                                reference.gradient_accumulation_steps)
    dataset = Pairs(17)
    order = DeepSpeedOrder.from_config(dataset, config, dp)
    mbs, m = order.micro_batch_size, order.micro_batches
    streams = [deepspeed_stream(dataset, mbs, dp, d, None, reference.dataloader_drop_last) for d in range(dp)]
    assert_order_matches(order, streams, steps_for(order), m)


@pytest.mark.parametrize("config", [
    {"train_batch_size": 13, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2},
    {"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2},
    {"gradient_accumulation_steps": 2},
    {"train_micro_batch_size_per_gpu": "auto"},
])
def test_from_config_refuses_inconsistent_batch_keys(config: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="train_batch_size|train_micro_batch_size_per_gpu"):
        DeepSpeedOrder.from_config(Pairs(8), config, 2)


def test_from_config_refuses_curriculum_sampling() -> None:
    config = {"train_micro_batch_size_per_gpu": 2,
              "data_efficiency": {"data_sampling": {"curriculum_learning": {"enabled": True}}}}
    with pytest.raises(NotAddressableError, match="curriculum"):
        DeepSpeedOrder.from_config(Pairs(8), config, 2)


def test_random_access_reads_only_the_batch() -> None:
    dataset = Pairs(1_000_003)
    order = DeepSpeedOrder(dataset, 8, 4, 16, drop_last=True)
    start = time.perf_counter()
    inputs, labels = order.micro_batch(10**9, 3, 15)
    assert time.perf_counter() - start < 0.05
    assert dataset.reads == 8 and inputs.shape == (8, 3) and labels.shape == (8,)
    k = (10**9 * 16 + 15) % order.batches_per_epoch
    assert inputs[0, 0].item() == 3 + 4 * 8 * k  # sample j of rank d is d + D*j without shuffle


def test_micro_batches_of_a_step_are_distinct_and_cover_the_epoch() -> None:
    dataset = Pairs(48)  # 24 batches of 2 per epoch over D=2: exactly one step of M=12
    order = DeepSpeedOrder(dataset, 2, 2, 12)
    seen = sorted(i for d in range(2) for m in range(12) for i in order.sample_indices(0, d, m))
    assert seen == list(range(48))


def test_resume_continues_the_stream_and_checks_the_order() -> None:
    dataset = Pairs(25)
    order = DeepSpeedOrder(dataset, 3, 2, 2)
    streams = [deepspeed_stream(dataset, 3, 2, d, None, False) for d in range(2)]
    for stream in streams:  # a vanilla run that trained 7 steps
        for _ in range(7 * 2):
            next(stream)
    resumed = DeepSpeedOrder(Pairs(25), 3, 2, 2)
    resumed.check_state(order.state_dict())
    assert_order_matches(resumed, streams, 6, 2, first_step=7)
    for d in range(2):
        it = order.stream(d, step=7)
        assert_same(next(it), resumed.micro_batch(7, d, 0))
    with pytest.raises(ValueError, match="micro_batches: saved 2, now 4"):
        DeepSpeedOrder(dataset, 3, 2, 4).check_state(order.state_dict())


def test_argument_errors_name_the_bound() -> None:
    order = DeepSpeedOrder(Pairs(10), 2, 2, 3)
    with pytest.raises(ValueError, match=r"index 3 is outside \[0, 3\)"):
        order.micro_batch(0, 0, 3)
    with pytest.raises(ValueError, match=r"pipeline 2 is outside \[0, 2\)"):
        order.micro_batch(0, 2, 0)
    with pytest.raises(ValueError, match="fewer than micro_batch_size=4 with drop_last"):
        DeepSpeedOrder(Pairs(5), 4, 2, 1, drop_last=True)


# ---- train_batch(data_iter=...) over a user's DataLoader with a DistributedSampler ----------------------------


def user_loader(dataset: Dataset[Any], dp: int, rank: int, *, shuffle: bool, drop_last: bool,
                sampler_drop_last: bool, epoch: int = 0, collate: Callable[..., Any] | None = None,
                workers: int = 0) -> DataLoader[Any]:
    sampler = DistributedSampler(dataset, num_replicas=dp, rank=rank, shuffle=shuffle, seed=11,
                                 drop_last=sampler_drop_last)
    sampler.set_epoch(epoch)
    return DataLoader(dataset, batch_size=3, sampler=sampler, drop_last=drop_last, collate_fn=collate,
                      num_workers=workers)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last,sampler_drop_last", [(False, False), (True, False), (False, True)])
def test_repeating_loader_over_distributed_sampler(shuffle: bool, drop_last: bool, sampler_drop_last: bool) -> None:
    dataset, dp = Records(26), 3
    loaders = [user_loader(dataset, dp, d, shuffle=shuffle, drop_last=drop_last,
                           sampler_drop_last=sampler_drop_last, epoch=4, collate=tuple_collate) for d in range(dp)]
    streams = [RepeatingLoader(loader) for loader in loaders]
    order = DeepSpeedOrder.from_data_iter(streams[1], 2, data_parallel_size=dp, data_parallel_rank=1)
    assert (order.shuffle, order.sampler_epoch, order.seed) == (shuffle, 4, 11)
    assert_order_matches(order, streams, steps_for(order), 2)


def test_repeating_loader_read_mid_stream() -> None:
    dataset, dp = Pairs(20), 2
    streams = [RepeatingLoader(user_loader(dataset, dp, d, shuffle=True, drop_last=False, sampler_drop_last=False))
               for d in range(dp)]
    for stream in streams:  # 4 steps of M=3 already trained: 12 batches, past the first epoch of 4
        for _ in range(12):
            next(stream)
    order = DeepSpeedOrder.from_data_iter(streams[0], 3, step=4)
    assert_order_matches(order, streams, steps_for(order), 3, first_step=4)


def test_iter_of_a_dataloader_is_one_epoch_from_its_position() -> None:
    dataset, dp = Pairs(20), 2
    iterators = [iter(user_loader(dataset, dp, d, shuffle=True, drop_last=False, sampler_drop_last=False,
                                  workers=w)) for d, w in zip(range(dp), (0, 2))]
    for it in iterators:
        next(it)
    order = DeepSpeedOrder.from_data_iter(iterators[1], 1, step=1)  # the 2-process iterator, 1 batch read
    assert not order.repeat and order.consumed == 1 and order.batches_per_epoch == 4
    assert_order_matches(order, iterators, 3, 1, first_step=1)
    for it in iterators:
        with pytest.raises(StopIteration):
            next(it)
    with pytest.raises(IndexError, match="StopIteration"):
        order.micro_batch(4, 0, 0)


def test_a_dataloader_itself_is_read_as_repeating() -> None:
    dataset = Pairs(9)
    loaders = [user_loader(dataset, 2, d, shuffle=False, drop_last=False, sampler_drop_last=False) for d in range(2)]
    order = DeepSpeedOrder.from_data_iter(loaders[0], 2)
    assert order.repeat and order.consumed == 0
    assert_order_matches(order, [RepeatingLoader(loader) for loader in loaders], steps_for(order), 2)


def test_engine_data_iterator_fresh_is_addressable_and_started_is_refused() -> None:
    dataset = Pairs(13)
    engine_iter = deepspeed_stream(dataset, 2, 2, 0, None, True)  # what engine.data_iterator holds
    order = DeepSpeedOrder.from_data_iter(engine_iter, 2)
    assert order.state_dict() == DeepSpeedOrder(dataset, 2, 2, 2, drop_last=True).state_dict()
    next(engine_iter)
    with pytest.raises(NotAddressableError, match="position is unknown"):
        DeepSpeedOrder.from_data_iter(engine_iter, 2)


def _refused() -> list[tuple[str, Any]]:
    dataset = Pairs(12)

    class Stream(IterableDataset[int]):
        def __iter__(self) -> Iterator[int]:
            return iter(range(12))

    class Reordered(DistributedSampler[Any]):
        def __iter__(self) -> Iterator[Any]:
            return reversed(list(super().__iter__()))

    class Batches(BatchSampler):
        pass

    ok = DistributedSampler(dataset, num_replicas=2, rank=0)
    return [
        ("a generator", (b for b in DataLoader(dataset, batch_size=2, sampler=ok))),
        ("a list", [1, 2, 3]),
        ("SequentialSampler", DataLoader(dataset, batch_size=2)),
        ("RandomSampler", DataLoader(dataset, batch_size=2, sampler=RandomSampler(dataset))),
        ("IterableDataset", DataLoader(Stream(), batch_size=2)),
        ("batch_size=None", DataLoader(dataset, batch_size=None, sampler=ok)),
        ("a custom batch sampler", DataLoader(dataset, batch_sampler=Batches(ok, 2, False))),
        ("an overridden __iter__", DataLoader(dataset, batch_size=2, sampler=Reordered(dataset, 2, 0))),
        ("another dataset", DataLoader(dataset, batch_size=2, sampler=DistributedSampler(Pairs(12), 2, 0))),
        ("a wrapped generator", RepeatingLoader(iter([1, 2]))),
    ]


@pytest.mark.parametrize("what,data", _refused(), ids=[w for w, _ in _refused()])
def test_unaddressable_data_is_refused_with_the_remedy(what: str, data: Any) -> None:
    with pytest.raises(NotAddressableError) as err:
        as_addressable(data, 2)
    message = str(err.value)
    for remedy in ("re-routes a failed pipeline", "training_data=", "DistributedSampler",
                   "micro_batch(step, pipeline, index)"):
        assert remedy in message, (what, message)


def test_sampler_disagreeing_with_the_job_is_refused() -> None:
    loader = user_loader(Pairs(12), 2, 1, shuffle=False, drop_last=False, sampler_drop_last=False)
    with pytest.raises(NotAddressableError, match="num_replicas=2 ranks but the job has 4 pipelines"):
        DeepSpeedOrder.from_data_iter(loader, 2, data_parallel_size=4)
    with pytest.raises(NotAddressableError, match="rank=1 but this worker is pipeline 0"):
        DeepSpeedOrder.from_data_iter(loader, 2, data_parallel_rank=0)


def test_an_object_with_the_hook_is_its_own_addressable_data() -> None:
    class Hooked:
        def micro_batch(self, step: int, pipeline: int, index: int) -> tuple[int, int, int]:
            return step, pipeline, index

    hooked = Hooked()
    assert as_addressable(hooked, 4) is hooked
    assert isinstance(hooked, AddressableData)
    assert isinstance(DeepSpeedOrder(Pairs(4), 1, 1, 1), AddressableData)


# ---- the real engine ----------------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_stock_pipeline_engines_read_exactly_this_order() -> None:
    """Two ranks (1 stage x 2 pipelines) of stock ``deepspeed.initialize(training_data=...)``: three epochs of
    ``engine.data_iterator`` equal ``from_config``'s order on the engine's own data-parallel rank, and
    ``from_engine`` and ``from_data_iter(engine.data_iterator)`` read the same order off the engine."""
    outs = spawn(2, ["tests/data/_order_job.py"], timeout=240)
    reports = [json.loads(line.split("REPORT ", 1)[1]) for out in outs for line in out.splitlines()
               if line.startswith("REPORT ")]
    assert len(reports) == 2
    assert sorted(r[0]["rank"] for r in reports) == [0, 1]
    for report in reports:
        for case in report:
            assert case["compared"] >= 12 and case["mismatches"] == [], case
            assert case["batches_per_epoch"][0] == case["batches_per_epoch"][1], case
            assert case["from_data_iter_agrees"] and case["from_engine_agrees"], case
