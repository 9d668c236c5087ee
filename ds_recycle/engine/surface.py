"""DeepSpeed's public engine API as the ReCycle engine treats it: every name honoured or refused at the call.

A script written for DeepSpeed's ``PipelineEngine`` may call any of its public methods. Each one (DeepSpeed 0.19.8's
``PipelineEngine``, ``DeepSpeedEngine`` and ``torch.nn.Module``) falls in exactly one group here, and
``tests/engine/test_surface.py`` walks ``dir(PipelineEngine)`` so that a name DeepSpeed adds cannot slip through
unclassified:

- :data:`OWN`: the ReCycle engine's own implementation, DeepSpeed's behaviour under failures too
  (``train_batch``, ``eval_batch``, the checkpoint calls, ``set_batch_fn``, ...);
- :data:`INHERITED`: DeepSpeed's implementation is right as it is: getters of the config, of the batch and of the
  ranks, ``torch.nn.Module``'s API on the stage's module, DeepSpeed's own refusals (``forward``, ``backward``,
  ``step`` raise in pipeline mode, as in DeepSpeed);
- :data:`REFUSED`: calls whose DeepSpeed implementation would be silently wrong here (it changes the batch the
  plan was made for, reduces gradients outside the plan, or reads state ZeRO or fp16 would have): they raise
  :class:`UnsupportedCallError` naming the method and the fix.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

__all__ = ["INHERITED", "INHERITED_PREFIXES", "OWN", "REFUSED", "UnsupportedCallError", "classify", "refusal"]


class UnsupportedCallError(NotImplementedError):
    """A DeepSpeed engine method the ReCycle engine does not run (see :data:`REFUSED`)."""


OWN = frozenset({
    "train_batch", "eval_batch", "save_checkpoint", "load_checkpoint", "set_batch_fn", "set_dataloader",
    "set_dataiterator", "was_step_applied", "get_global_grad_norm",
})
"""Implemented by the ReCycle engine (see each method's docstring)."""

INHERITED_PREFIXES = ("autotuning_", "flops_profiler_", "zero_", "curriculum_", "data_efficiency_", "data_sampling_",
                      "random_ltd_config", "random_ltd_enabled", "checkpoint_", "get_", "is_", "torch_autocast_",
                      "register_", "named_", "dynamic_loss_scale", "fp16_", "bf16_", "bfloat16")
"""Prefixes of inherited names: config getters, rank/batch getters and ``torch.nn.Module`` registration API."""

INHERITED = frozenset({
    # config getters
    "aio_config", "autotp_size", "communication_data_type", "dataloader_drop_last", "gradient_accumulation_steps",
    "gradient_clipping", "gradient_predivide_factor", "initial_dynamic_scale", "loss_scale", "memory_breakdown",
    "optimizer_legacy_fusion", "optimizer_name", "optimizer_params", "postscale_gradients", "scheduler_name",
    "scheduler_params", "sparse_gradients_enabled", "steps_per_print", "swap_tensor_config", "tensor_parallel_config",
    "train_batch_size", "train_micro_batch_size_per_gpu", "wall_clock_breakdown", "zenflow_config", "log_level",
    "use_node_local_storage", "uses_parallelization_pass_only", "cpuadam_cores_perc", "super_offload",
    "clip_fp32_gradients", "collect_python_gc", "tput_log", "log_for_device", "dump_state", "print_forward_breakdown",
    "deepspeed_io", "is_map_style_dataset", "is_iterable_style_dataset", "reset_activation_shape",
    "DTYPE_TO_ID", "ID_TO_DTYPE", "T_destination", "dump_patches", "call_super_init",
    # DeepSpeed refuses these itself in pipeline mode (PipelineError), as a script expects
    "forward", "backward", "step",
    # torch.nn.Module's API over the stage's module
    "add_module", "apply", "buffers", "children", "cpu", "cuda", "double", "eval", "extra_repr", "float", "half",
    "ipu", "load_state_dict", "modules", "mtia", "parameters", "requires_grad_", "share_memory", "state_dict", "to",
    "to_empty", "train", "type", "xpu", "zero_grad", "set_extra_state", "set_submodule",
    "scale", "destroy", "managed_gradient_accumulation", "load_universal_checkpoint",
})
"""DeepSpeed's (or ``torch.nn.Module``'s) implementation, right as it is for the ReCycle engine."""

_BATCH = ("the plan is made for the batch of the config (micro-batch size and count); set it in the config and "
          "start the job again")
_REDUCE = "gradients are reduced per stage by the plan's instructions inside train_batch; call train_batch only"
REFUSED: dict[str, str] = {
    "set_train_batch_size": _BATCH,
    "set_train_micro_batch_size": _BATCH,
    "set_gradient_accumulation_boundary": _REDUCE,
    "allreduce_gradients": _REDUCE,
    "allreduce_bucket": _REDUCE,
    "allreduce_and_copy": _REDUCE,
    "allreduce_no_retain": _REDUCE,
    "buffered_allreduce_fallback": _REDUCE,
    "sparse_allreduce": _REDUCE,
    "sparse_allreduce_bucket": _REDUCE,
    "sparse_allreduce_no_retain": _REDUCE,
    "sparse_all_gather": _REDUCE,
    "all_gather_scalar": _REDUCE,
    "no_sync": _REDUCE,
    "coalesce_grad_reduction": _REDUCE,
    "compile": "compiled modules are not run by the B/W split; train without engine.compile()",
    "compile_autosp": "compiled modules are not run by the B/W split; train without engine.compile()",
    "compile_autotp": "compiled modules are not run by the B/W split; train without engine.compile()",
    "compile_zero_optimization_stage": "ZeRO partitions are not supported (zero_optimization.stage 0)",
    "module_state_dict": "save with engine.save_checkpoint (it writes the stage's layer files)",
    "load_module_state_dict": "load with engine.load_checkpoint (it reads the stage's layer files)",
    "register_compile_pass": "compiled modules are not run by the B/W split; train without engine.compile()",
    "offload_states": "the optimizer state stays whole on every replica (a peer may take over a stage); no offload",
    "reload_states": "the optimizer state stays whole on every replica (a peer may take over a stage); no offload",
    "empty_partition_cache": "ZeRO partitions are not supported (zero_optimization.stage 0)",
    "save_16bit_model": "save with engine.save_checkpoint (DeepSpeed's layout, loadable by vanilla DeepSpeed)",
    "save_fp16_model": "save with engine.save_checkpoint (DeepSpeed's layout, loadable by vanilla DeepSpeed)",
    "load_moe_state_dict": "mixture-of-experts layers are not supported; use dense layers",
    "set_custom_curriculum_learning_schedule": "curriculum learning changes the batch per step; not supported",
    "set_data_post_process_func": "use engine.set_batch_fn (it runs wherever a micro-batch runs, on a peer too)",
    "random_ltd_initialize": "random layer-token drop changes the layers per step; not supported",
    "set_has_attention_mask": "the stage boundaries carry tuples of tensors as the layers return them; not needed",
}
"""Refused at the call: name -> the fix."""


def classify(name: str) -> str | None:
    """``"own"``, ``"inherited"``, ``"refused"`` or None (not classified) for a public engine attribute."""
    if name in OWN:
        return "own"
    if name in REFUSED:
        return "refused"
    if name in INHERITED or name.startswith(INHERITED_PREFIXES):
        return "inherited"
    return None


def refusal(name: str) -> Callable[..., NoReturn]:
    """The method that takes ``name``'s place: it raises :class:`UnsupportedCallError` naming it and the fix."""
    fix = REFUSED[name]

    def refused(*args: Any, **kwargs: Any) -> NoReturn:
        raise UnsupportedCallError(f"engine.{name}() is not supported by ds_recycle's engine: {fix}")
    refused.__name__ = refused.__qualname__ = name
    refused.__doc__ = f"Refused: {fix}."
    return refused
