"""The top-level keys a DeepSpeed 0.19.8 config may hold, so that a misspelt section is refused, not ignored.

DeepSpeed itself ignores top-level keys it does not know (a ``"recyle"`` section would silently run with our
defaults). The list was gathered from DeepSpeed 0.19.8's sources (the keys its config classes read from the
top-level dict: ``runtime/config.py``, the monitor, profiler, checkpointing, compression, data-efficiency,
elasticity, autotuning, ZeRO and MoE config readers) and its configuration documentation. A key DeepSpeed
0.19.8 reads at the top level but missing here is a bug of this list: add it.
"""
from __future__ import annotations

__all__ = ["DEEPSPEED_TOP_LEVEL_KEYS"]

DEEPSPEED_TOP_LEVEL_KEYS: frozenset[str] = frozenset({
    # batch and steps
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "steps_per_print",
    "dataloader_drop_last", "managed_gradient_accumulation",
    # optimizer, schedule, gradients
    "optimizer", "scheduler", "gradient_clipping", "prescale_gradients", "gradient_predivide_factor",
    "gradient_allreduce_op", "sparse_gradients", "communication_data_type", "seq_parallel_communication_data_type",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "disable_allgather", "allgather_size",
    # precision
    "fp16", "bf16", "bfloat16", "amp", "torch_autocast", "data_types",
    # memory, parallelism
    "zero_optimization", "aio", "activation_checkpointing", "pipeline", "tensor_parallel", "expert_parallel",
    "sequence_parallel_size", "use_data_before_expert_parallelism", "moe", "hybrid_engine", "zenflow",
    # checkpoints
    "checkpoint", "nebula", "datastates_ckpt",
    # monitoring and profiling
    "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "flops_profiler", "wall_clock_breakdown",
    "memory_breakdown", "dump_state", "timers", "log_level", "throughput",
    # training techniques
    "sparse_attention", "curriculum_learning", "data_efficiency", "random_ltd", "progressive_layer_drop",
    "eigenvalue", "quantize_training", "compression_training", "weight_quantization", "elasticity", "autotuning",
    "model_info", "compile", "graph_harvesting", "disable_python_gc",
})
