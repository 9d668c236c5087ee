"""One-process checks of what ``ds_recycle.initialize`` refuses at start (run by test_initialize.py).

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/engine/_refusals_job.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule

    import ds_recycle
    from ds_recycle.resilience.world import init_worker

    init_worker()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    report: dict[str, str] = {}

    def refused(name: str, model: Any, **kwargs: Any) -> None:
        try:
            ds_recycle.initialize(model=model, config=kwargs.pop("config", config), **kwargs)
        except ValueError as e:
            report[name] = str(e)
        else:
            report[name] = "ACCEPTED"

    plain = [LayerSpec(torch.nn.Linear, 4, 4), LayerSpec(torch.nn.Linear, 4, 1)]
    refused("not_pipeline", torch.nn.Linear(4, 1))
    refused("checkpointing", PipelineModule(layers=plain, num_stages=1, loss_fn=torch.nn.MSELoss(),
                                            activation_checkpoint_interval=1,
                                            activation_checkpoint_func=lambda f, *args: f(*args)))
    refused("fp16", PipelineModule(layers=plain, num_stages=1, loss_fn=torch.nn.MSELoss()),
            config={**config, "fp16": {"enabled": True}})
    refused("zero", PipelineModule(layers=plain, num_stages=1, loss_fn=torch.nn.MSELoss()),
            config={**config, "zero_optimization": {"stage": 2}})
    refused("no_optimizer", PipelineModule(layers=plain, num_stages=1, loss_fn=torch.nn.MSELoss()),
            config={"train_micro_batch_size_per_gpu": 2})
    refused("not_a_dataset", PipelineModule(layers=plain, num_stages=1, loss_fn=torch.nn.MSELoss()),
            training_data=object())
    engine, optimizer, loader, scheduler = ds_recycle.initialize(
        model=PipelineModule(layers=plain, num_stages=1, loss_fn=torch.nn.MSELoss()), config=config)
    report["accepted"] = f"{type(engine).__name__} {type(optimizer).__name__} {loader} {scheduler}"
    bf16, bf16_optimizer, _, _ = ds_recycle.initialize(
        model=PipelineModule(layers=plain, num_stages=1, loss_fn=torch.nn.MSELoss()),
        config={**config, "bf16": {"enabled": True}})
    report["bf16"] = (f"{type(bf16_optimizer).__name__} {next(bf16.module.parameters()).dtype} "
                      f"{bf16_optimizer.param_groups[0]['params'][0].dtype}")
    try:
        engine.train_batch(data_iter=iter([(torch.zeros(2, 4), torch.zeros(2, 1))]))
    except ValueError as e:
        report["plain_iterator"] = str(e)
    report.update(_engine_api(config))
    ds_recycle.initialize(model=PipelineModule(layers=[LayerSpec(torch.nn.Linear, 4, 4),
                                                       LayerSpec(torch.nn.BatchNorm1d, 4),
                                                       LayerSpec(torch.nn.Linear, 4, 1)],
                                               num_stages=1, loss_fn=torch.nn.MSELoss()), config=config)
    print("REPORT " + json.dumps(report))
    return 0


def _engine_api(config: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's engine API as a script uses it: ``config``, ``set_batch_fn``, ``set_dataiterator``,
    ``set_dataloader``, ``was_step_applied``, ``get_global_grad_norm``."""
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    import ds_recycle

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    user = {**config, "gradient_clipping": 1.0}
    engine, _, _, _ = ds_recycle.initialize(
        model=PipelineModule(layers=[LayerSpec(torch.nn.Linear, 4, 4), LayerSpec(torch.nn.Linear, 4, 1)],
                             num_stages=1, loss_fn=torch.nn.MSELoss()), config=user, training_data=data)
    out: dict[str, Any] = {"config_is_users": engine.config == user, "applied_before": engine.was_step_applied()}
    seen: list[int] = []

    def batch_fn(batch: Any) -> Any:
        seen.append(len(batch[0]))
        return batch[0], batch[1] * 0.0 + 100.0  # labels far off: a large loss shows the function ran
    engine.set_batch_fn(batch_fn)
    out["batch_fn_loss"] = float(engine.train_batch())
    out["batch_fn_calls"] = seen
    out["applied_after"] = engine.was_step_applied()
    out["norm"] = engine.get_global_grad_norm()
    engine.set_batch_fn(None)
    loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=1, rank=0, shuffle=False))
    engine.set_dataloader(loader)
    out["dataloader_loss"] = float(engine.train_batch())
    engine.set_dataiterator(iter(loader))
    out["dataiterator_loss"] = float(engine.train_batch())
    return out


if __name__ == "__main__":
    sys.exit(main())
