"""The config of a user's job: DeepSpeed's JSON, with an optional ``"recycle"`` section, for a module and world.

``ds_recycle.initialize`` gets what ``deepspeed.initialize`` gets: a DeepSpeed config (a dict, a path, or
``args.deepspeed_config``) and a ``PipelineModule``. :func:`job_config` reads it the way DeepSpeed does,
with ReCycle's additions:

- ``S`` is the module's ``num_stages`` and ``D`` the world size over ``S``; ``recycle.stages`` and
  ``recycle.pipelines`` may be omitted, and when given must agree;
- any two of ``train_batch_size``, ``train_micro_batch_size_per_gpu`` and ``gradient_accumulation_steps``
  (or one, as DeepSpeed allows) determine the third, with DeepSpeed's rules; all three are then written out;
- an ``"optimizer"`` block of type Adam or AdamW is built by DeepSpeed as torch's optimizer on a CPU machine
  (``torch_adam``; ``weight_decay`` defaults to 0, as for DeepSpeed's fused Adam), never JIT-compiled;
- ``"bf16": {"enabled": true}`` trains with bf16 weights and fp32 master weights, gradients accumulated and
  reduced in fp32 (:mod:`ds_recycle.engine.precision`); ``data_types.grad_accum_dtype`` may be omitted or fp32
  (it is taken out of the config DeepSpeed's engine sees, which refuses fp32 accumulation at ZeRO stage 0);
- what ReCycle cannot run is refused here, with the reason and the fix: ZeRO stage 1 or more (it shards the
  optimizer state ReCycle needs replicated on every pipeline), fp16 (its dynamic loss scaling skips steps on
  overflow, which the staggered optimizer step does not do), bf16 with bf16 gradient accumulation or
  communication, a world size that is not a multiple of ``S``.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_recycle.config._strict import load_json_object, parse_dataclass, to_jsonable
from ds_recycle.config.errors import ConfigError
from ds_recycle.config.schema import RecycleConfig

__all__ = ["JobConfig", "batch_sizes", "job_config", "read_deepspeed_config"]

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


@dataclass(frozen=True)
class JobConfig:
    """A user job's resolved configuration."""

    recycle: RecycleConfig
    """The ``"recycle"`` section with ``stages`` and ``pipelines`` taken from the module and the world."""
    deepspeed: dict[str, Any]
    """The config DeepSpeed's engine is built with (no ``"recycle"``; batch keys resolved)."""
    micro_batch_size: int
    micro_batches: int
    """Micro-batches per pipeline per iteration, ``M`` (DeepSpeed's gradient_accumulation_steps)."""
    gradient_clipping: float

    def resolved(self) -> dict[str, Any]:
        """The whole resolved configuration, for the start-up log and the metrics."""
        return {"recycle": to_jsonable(self.recycle), "deepspeed": self.deepspeed}


def read_deepspeed_config(config: str | Path | dict[str, Any] | None, args: Any = None,
                          config_params: dict[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpeed config dict from ``config`` (dict or path), ``config_params`` or ``args.deepspeed_config``."""
    source: Any = config if config is not None else config_params
    if source is None and args is not None:
        source = getattr(args, "deepspeed_config", None)
    if source is None:
        raise ConfigError("--deepspeed_config", "no DeepSpeed config given",
                          "pass config=dict or a path, or args with args.deepspeed_config")
    if isinstance(source, dict):
        return dict(source)
    return load_json_object(str(source))


def job_config(source: dict[str, Any], *, stages: int, world_size: int, cpu: bool = True,
               absent: frozenset[tuple[int, int]] = frozenset()) -> JobConfig:
    """Resolve ``source`` for a job of ``stages`` stages on ``world_size`` workers (see the module docstring).

    ``absent``: the workers a module built on a grid with holes lacks from the start (``world_size`` counts
    them); ``recycle.assume_failed`` must name exactly those.
    """
    if world_size % stages:
        raise ConfigError("num_stages", f"{world_size} processes are not a multiple of the module's {stages} stages",
                          f"launch a multiple of {stages} processes, or build the PipelineModule with a "
                          "num_stages that divides the world size")
    pipelines = world_size // stages
    raw = dict(source)
    section = raw.pop("recycle", {})
    if not isinstance(section, dict):
        raise ConfigError("recycle", f"expected a JSON object, got {section!r}", "write 'recycle' as {...}")
    for key, have, where in (("stages", stages, "the PipelineModule's num_stages"),
                             ("pipelines", pipelines, f"the world size {world_size} over {stages} stages")):
        if key in section and section[key] != have:
            raise ConfigError(f"recycle.{key}", f"{section[key]!r}, but {where} is {have}",
                              f"remove recycle.{key} (it comes from the job) or set it to {have}")
    recycle = parse_dataclass(RecycleConfig, {**section, "stages": stages, "pipelines": pipelines}, "recycle")
    if frozenset(recycle.assume_failed) != absent:
        if not absent:
            raise ConfigError("recycle.assume_failed", "a PipelineModule built with num_stages= needs every worker "
                              "at start", "launch all S x D workers and empty assume_failed (to try a failure, kill "
                              "a worker: its peers take over its micro-batches)")
        raise ConfigError("recycle.assume_failed", f"{sorted(recycle.assume_failed)}, but the module's grid lacks "
                          f"{sorted(absent)}", "list exactly the workers the module was built without")
    mbs, gas = _resolve_batch(raw, pipelines)
    _refuse_unsupported(raw)
    clip = raw.setdefault("gradient_clipping", 1.0)  # DeepSpeed's own default, made explicit
    if not isinstance(clip, (int, float)) or isinstance(clip, bool) or clip < 0:
        raise ConfigError("gradient_clipping", f"{clip!r} is not a non-negative number", "use 0.0 (off) or e.g. 1.0")
    if cpu and "optimizer" in raw:
        raw["optimizer"] = _torch_adam_on_cpu(raw["optimizer"])
    return JobConfig(recycle=recycle, deepspeed=raw, micro_batch_size=mbs, micro_batches=gas,
                     gradient_clipping=float(clip))


def _positive(raw: dict[str, Any], key: str) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(key, f"{value!r} is not a positive integer", f"set '{key}' to a positive integer")
    return value


def batch_sizes(config: Mapping[str, Any], dp: int) -> tuple[int, int]:
    """``(train_micro_batch_size_per_gpu, gradient_accumulation_steps)`` from any of DeepSpeed's batch keys,
    resolved as DeepSpeed 0.19.8 does (``runtime/config.py`` ``_set_batch_related_parameters``) for ``dp``
    data-parallel replicas."""
    raw = dict(config)
    tbs, mbs, gas = (_positive(raw, k) for k in _BATCH_KEYS)
    if tbs is None and mbs is None:
        raise ConfigError("train_micro_batch_size_per_gpu", "neither it nor train_batch_size is set",
                          "set two of train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps")
    if tbs is not None and mbs is not None and gas is None:
        gas = tbs // (mbs * dp)
    elif tbs is not None and mbs is None:
        gas = gas or 1
        mbs = tbs // (gas * dp)
    gas = gas or 1
    assert mbs is not None
    want = mbs * gas * dp
    if mbs < 1 or gas < 1 or (tbs is not None and tbs != want):
        raise ConfigError("train_batch_size", f"{tbs} is not train_micro_batch_size_per_gpu ({mbs}) x "
                          f"gradient_accumulation_steps ({gas}) x data-parallel size ({dp}) = {want}",
                          f"set train_batch_size to {want}, or change the factors so they multiply to it")
    return mbs, gas


def _resolve_batch(raw: dict[str, Any], dp: int) -> tuple[int, int]:
    mbs, gas = batch_sizes(raw, dp)
    raw.update(train_batch_size=mbs * gas * dp, train_micro_batch_size_per_gpu=mbs, gradient_accumulation_steps=gas)
    return mbs, gas


def _refuse_unsupported(raw: dict[str, Any]) -> None:
    zero = raw.get("zero_optimization", {})
    stage = zero.get("stage", 0) if isinstance(zero, dict) else zero
    if stage not in (0, False, None):
        raise ConfigError("zero_optimization.stage", f"{stage!r}: ZeRO stage 1 or more shards the optimizer state "
                          "across the data-parallel replicas, the very state ReCycle needs whole on every pipeline to "
                          "take over a failed worker's micro-batches", "use stage 0 (or run without ds_recycle)")
    fp16 = raw.get("fp16", {})
    if isinstance(fp16, dict) and fp16.get("enabled", False):
        raise ConfigError("fp16.enabled", "fp16 needs dynamic loss scaling, which skips the optimizer step of an "
                          "iteration whose gradients overflow; the ReCycle engine's staggered step does not skip or "
                          "scale (loss scaling is not supported)", "use \"bf16\": {\"enabled\": true} (no loss "
                          "scaling needed) or fp32, or recycle.enabled false")
    bf16 = raw.get("bf16", raw.get("bfloat16", {}))
    if isinstance(bf16, dict) and bf16.get("enabled", False):
        _bf16_data_types(raw)


_FP32_NAMES = ("fp32", "float32", "float", "torch.float32")


def _bf16_data_types(raw: dict[str, Any]) -> None:
    """bf16 accumulates and reduces gradients in fp32 (exact rows): refuse a lower precision, hide fp32 from DeepSpeed."""
    types = raw.get("data_types")
    if isinstance(types, dict) and "grad_accum_dtype" in types:
        accum = types["grad_accum_dtype"]
        if str(accum).lower() not in _FP32_NAMES:
            raise ConfigError("data_types.grad_accum_dtype", f"{accum!r}: with bf16 the ReCycle engine accumulates "
                              "weight gradients in fp32, so that a re-routed micro-batch adds to the same sum "
                              "wherever it runs", "remove data_types.grad_accum_dtype or set it to \"fp32\"")
        rest = {k: v for k, v in types.items() if k != "grad_accum_dtype"}
        if rest:
            raw["data_types"] = rest
        else:
            del raw["data_types"]
    comm = raw.get("communication_data_type")
    if comm is not None and str(comm).lower() not in _FP32_NAMES:
        raise ConfigError("communication_data_type", f"{comm!r}: with bf16 the ReCycle engine reduces the fp32 "
                          "gradient rows in fp32 (a bf16 all-reduce would round them)",
                          "remove communication_data_type or set it to \"fp32\"")


def _torch_adam_on_cpu(block: Any) -> Any:
    """Adam/AdamW built as torch's optimizer (``torch_adam``) with fused Adam's defaults, not JIT-compiled."""
    if not isinstance(block, dict) or str(block.get("type", "")).lower() not in ("adam", "adamw"):
        return block
    params = dict(block.get("params", {}))
    if "torch_adam" not in params:
        params["torch_adam"] = True
        params.setdefault("weight_decay", 0.0)  # fused Adam's default; torch's AdamW would use 0.01
    return {**block, "params": params}

