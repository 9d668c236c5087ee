"""Vanilla DeepSpeed's own pipeline loader against DeepSpeedOrder: prints a JSON report for test_addressable.py.

Each rank of a 1-stage x D-pipeline job builds a stock ``PipelineEngine`` with ``training_data=`` and draws
three epochs of batches from ``engine.data_iterator`` (what ``train_batch`` reads), comparing each with
``DeepSpeedOrder.from_config(...).micro_batch(step, data-parallel rank, index)``::

    RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/data/_order_job.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

CONFIGS: list[dict[str, Any]] = [
    {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2},
    {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3, "dataloader_drop_last": True},
]


class Samples(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """25 samples ``((x, mask), y)``: not divisible by D x micro-batch size."""

    def __len__(self) -> int:
        return 25

    def __getitem__(self, i: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return (torch.randn(3, generator=g), torch.rand(3, generator=g) > 0.5), torch.tensor([float(i), -i])


def collate(samples: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tuples of tensors in, ``(inputs, labels)`` out, as a user's collate_fn would."""
    x = torch.stack([s[0][0] * s[0][1] for s in samples])
    return x, torch.stack([s[1] for s in samples])


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def main() -> int:
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.ops
    from deepspeed.pipe import PipelineModule

    from ds_recycle.data import DeepSpeedOrder

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    dp = torch.distributed.get_world_size()
    report: list[dict[str, Any]] = []
    for number, base in enumerate(CONFIGS):
        config = {**base, "steps_per_print": 10**9}
        model = PipelineModule(layers=[torch.nn.Linear(3, 2)], num_stages=1, loss_fn=torch.nn.MSELoss())
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                               config=config, training_data=Samples(),
                                               collate_fn=collate if number else None)
        order = DeepSpeedOrder.from_config(Samples(), config, dp, collate_fn=collate if number else None)
        rank = engine.grid.get_data_parallel_rank()
        assert DeepSpeedOrder.from_engine(engine).collate_fn is (collate if number else order.collate_fn)
        read = DeepSpeedOrder.from_data_iter(engine.data_iterator, order.micro_batches, data_parallel_size=dp,
                                             data_parallel_rank=rank)
        steps = 3 * order.batches_per_epoch // order.micro_batches + 2
        mismatches = [[t, i] for t in range(steps) for i in range(order.micro_batches)
                      if not same(next(engine.data_iterator), order.micro_batch(t, rank, i))]
        report.append({"rank": rank, "compared": steps * order.micro_batches, "mismatches": mismatches,
                       "batches_per_epoch": [order.batches_per_epoch, len(engine.training_dataloader.loader)],
                       "from_data_iter_agrees": read.state_dict() == order.state_dict(),
                       "from_engine_agrees": DeepSpeedOrder.from_engine(engine).state_dict() == order.state_dict()})
    print("REPORT " + json.dumps(report), flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
