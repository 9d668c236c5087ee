"""``ds_recycle.initialize`` twice in one worker under ``ds-recycle launch`` (run by test_initialize.py)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    import deepspeed
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule

    import ds_recycle

    deepspeed.init_distributed()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}

    def model() -> PipelineModule:
        return PipelineModule(layers=[LayerSpec(torch.nn.Linear, 4, 1)], num_stages=1, loss_fn=torch.nn.MSELoss())
    ds_recycle.initialize(model=model(), config=config)
    try:
        ds_recycle.initialize(model=model(), config=config)
    except ValueError as e:
        print(f"SECOND {e}", flush=True)
        return 0
    print("SECOND ACCEPTED", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
