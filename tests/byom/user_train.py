"""Train one of the small pipeline models of ``models.py`` with DeepSpeed, as a DeepSpeed user would.

    torchrun --standalone --nproc_per_node 4 user_train.py --deepspeed_config configs/fp32.json \
        --model alexnet --steps 20 --save-final final.pt
    deepspeed --num_accelerators 4 user_train.py --deepspeed_config configs/fp32.json --model gpt --steps 20

Each step prints ``step N loss X`` on rank 0. ``--save-final`` writes every stage's parameters, keyed by
DeepSpeed's layer-indexed names (``3.weight``, ``tied_modules.embed.weight``), to one file.
"""
import argparse

import deepspeed
import models
import torch
import torch.distributed as dist


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="DeepSpeed pipeline training of a small model")
    parser.add_argument("--model", choices=sorted(models.MODELS), default="alexnet")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--save-final", default=None, help="write the final parameters of every stage here")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the deepspeed launcher")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def save_final(engine: deepspeed.PipelineEngine, path: str) -> None:
    """Pipeline 0 gathers its stages' parameters on its first stage, which writes them to ``path``."""
    grid = engine.grid
    if grid.get_data_parallel_id() != 0:
        return
    state = {name: p.detach().float().cpu() for name, p in engine.module.named_parameters()}
    first = grid.stage_to_global(0)
    gathered: list | None = [None] * grid.get_pipe_parallel_world_size() if engine.global_rank == first else None
    dist.gather_object(state, gathered, dst=first, group=grid.get_pipe_parallel_group())
    if gathered is not None:
        merged: dict[str, torch.Tensor] = {}
        for stage_state in gathered:
            for name, tensor in stage_state.items():
                merged.setdefault(name, tensor)  # a tied weight: the first stage's copy
        torch.save(merged, path)


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    deepspeed.init_distributed()

    net, dataset = models.build(args.model, num_stages=args.stages, seed=args.seed)

    engine, _, _, _ = deepspeed.initialize(args=args, model=net, model_parameters=[p for p in net.parameters() if p.requires_grad], training_data=dataset)  # noqa: E501

    for step in range(args.steps):
        loss = engine.train_batch()
        if engine.global_rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)

    if args.save_final:
        save_final(engine, args.save_final)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
