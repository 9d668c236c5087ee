"""Train one of the small pipeline models of ``models.py`` with DeepSpeed, as a DeepSpeed user would.

    torchrun --standalone --nproc_per_node 4 user_train.py --deepspeed_config configs/fp32.json \
        --model alexnet --steps 20 --save-final final.pt
    deepspeed --num_accelerators 4 user_train.py --deepspeed_config configs/fp32.json --model gpt --steps 20

Each step prints ``step N loss X`` on rank 0. ``--save-final`` writes every stage's parameters, keyed by
layer-indexed names (``3.weight``), to one file, through a DeepSpeed checkpoint (written by the stages' first live
workers under ds_recycle, also after a failure).
"""
import argparse
from pathlib import Path

import deepspeed
import models
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="DeepSpeed pipeline training of a small model")
    parser.add_argument("--model", choices=sorted(models.MODELS), default="alexnet")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--save-final", default=None, help="write the final parameters of every stage here")
    parser.add_argument("--load", default=None, help="continue from this DeepSpeed checkpoint (tag 'final')")
    parser.add_argument("--save-dir", default=None, help="write a DeepSpeed checkpoint here every --save-every steps")
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--eval", action="store_true", help="after training, print every rank's eval_batch loss")
    parser.add_argument("--activation-checkpoint-interval", type=int, default=0,
                        help="checkpoint activations every N layers (PipelineModule.set_checkpoint_interval)")
    parser.add_argument("--sampler", choices=("sequential", "shuffled"), default=None,
                        help="feed train_batch(data_iter=...) from a Megatron-style batch sampler (samplers.py), "
                             "its batches post-processed by engine.set_batch_fn")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the deepspeed launcher")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def save_final(engine: deepspeed.PipelineEngine, path: str) -> None:
    """A DeepSpeed checkpoint next to ``path``; then rank 0 merges its layer files into one file at ``path``."""
    directory = Path(path).with_suffix(".ckpt")
    engine.save_checkpoint(str(directory), tag="final")
    if engine.global_rank == 0:
        merged: dict[str, torch.Tensor] = {}
        for layer in sorted((directory / "final").glob("layer_*-model_states.pt")):
            index = int(layer.name.split("_")[1].split("-")[0])
            for name, tensor in torch.load(layer, map_location="cpu", weights_only=True).items():
                merged[f"{index}.{name}"] = tensor.float()
        torch.save(merged, path)


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    deepspeed.init_distributed()

    net, dataset = models.build(args.model, num_stages=args.stages, seed=args.seed)
    if args.activation_checkpoint_interval:
        net.set_checkpoint_interval(args.activation_checkpoint_interval)

    engine, _, _, _ = deepspeed.initialize(args=args, model=net, model_parameters=[p for p in net.parameters() if p.requires_grad], training_data=dataset)  # noqa: E501

    data_iter = None
    if args.sampler:
        import samplers
        from deepspeed.utils import RepeatingLoader

        grid = engine.grid
        cls = samplers.SequentialSampler if args.sampler == "sequential" else samplers.ShuffledSampler
        batch_sampler = cls(len(dataset), 0, engine.train_micro_batch_size_per_gpu(),
                            grid.get_data_parallel_rank(), grid.get_data_parallel_world_size())
        data_iter = RepeatingLoader(DataLoader(dataset, batch_sampler=batch_sampler))
        engine.set_batch_fn(lambda batch: (batch[0] * 0.5 + 0.25, batch[1]))  # post-processing, Megatron-style
    start = 0
    if args.load:
        engine.load_checkpoint(args.load, tag="final")
        start = engine.global_steps
    for step in range(start, args.steps):
        loss = engine.train_batch() if data_iter is None else engine.train_batch(data_iter=data_iter)
        if engine.global_rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
        if args.save_dir and args.save_every and (step + 1) % args.save_every == 0:
            engine.save_checkpoint(args.save_dir)
    if args.eval:
        grid = engine.grid
        sampler = DistributedSampler(dataset, num_replicas=grid.get_data_parallel_world_size(),
                                     rank=grid.get_data_parallel_rank(), shuffle=False)
        loader = DataLoader(dataset, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler)
        value = engine.eval_batch(iter(loader))
        print(f"eval rank {engine.global_rank} loss {float(value):.6f}", flush=True)

    if args.save_final:
        save_final(engine, args.save_final)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
