"""Typed configuration: the DeepSpeed JSON file with a ``"recycle"`` section.

A config file is DeepSpeed's JSON plus one extra top-level key, ``"recycle"``::

    {
      "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 4,
      "train_batch_size": 32,
      "gradient_clipping": 1.0,
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
      "recycle": {
        "enabled": true,
        "stages": 2, "pipelines": 2,
        "model": {"n_layer": 4, "d_model": 128, "n_head": 4, "seq_len": 64},
        "data": {"seed": 1234}
      }
    }

:func:`load_config` parses the ``"recycle"`` section once into :class:`RecycleConfig`
(unknown keys rejected), checks it against the DeepSpeed keys it depends on and returns a
:class:`TrainConfig`. Everything downstream reads typed attributes.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ds_recycle.config._strict import load_json_object, parse_dataclass, to_jsonable
from ds_recycle.config.deepspeed_keys import DEEPSPEED_TOP_LEVEL_KEYS
from ds_recycle.config.errors import ConfigError

Worker = tuple[int, int]
"""A worker as ``(pipeline, stage)``."""

OPTIMIZERS = ("Adam", "AdamW", "SGD")


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the decoder-only transformer that :mod:`ds_recycle.model` builds."""

    vocab_size: int = 256
    """Tokens are bytes, so 256 covers every input."""
    seq_len: int = 64
    """Context length: tokens per sample."""
    n_layer: int = 4
    """Transformer blocks; DeepSpeed spreads them over the stages."""
    d_model: int = 128
    """Width of the residual stream."""
    n_head: int = 4
    """Attention heads; must divide ``d_model``."""
    mlp_ratio: int = 4
    """Hidden width of each MLP as a multiple of ``d_model``."""
    init_seed: int = 42
    """Layer ``i`` is initialised from seed ``init_seed + i``, whatever the partition or engine."""
    tie_embeddings: bool = False
    """The LM head uses the token embedding's table (GPT-2's weight tying), as DeepSpeed models do it: a
    ``TiedLayerSpec`` on the first and the last stage, the table's gradient summed over both."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "d_model", "n_head", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ConfigError(f"recycle.model.{name}", f"{getattr(self, name)} is below 1",
                                  "use a positive integer")
        if self.d_model % self.n_head:
            raise ConfigError("recycle.model.n_head", f"{self.n_head} heads do not divide d_model={self.d_model}",
                              f"pick n_head among the divisors of {self.d_model}")


@dataclass(frozen=True)
class DataConfig:
    """Where samples come from and how they are drawn."""

    corpus: Literal["python-reference"] = "python-reference"
    """The text: the Python language reference that ships with the interpreter (see ds_recycle.data)."""
    seed: int = 1234
    """Seed of the sampler: sample (iteration, pipeline, micro-batch, row) is a pure function of it."""
    holdout_fraction: float = 0.05
    """Tail of the corpus kept out of training, for evaluation."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.holdout_fraction < 0.5:
            raise ConfigError("recycle.data.holdout_fraction", f"{self.holdout_fraction} is outside [0, 0.5)",
                              "use a fraction such as 0.05")


FaultPhase = Literal["forward", "backward-input", "backward-weight", "last-backward-weight", "send", "receive",
                     "all-reduce", "optimizer-step", "idle", "layer-move", "layer-moved", "end-of-training", "ended",
                     "join-request", "join-groups", "join-transfer", "join-first-iteration"]


@dataclass(frozen=True)
class FaultConfig:
    """One injected failure: ``{"worker": [pipeline, stage], "iteration": N, "phase": "forward"}``.

    The worker dies by SIGKILL the first time it enters ``phase`` in iteration ``N`` (0-based). Only
    ``ds-recycle launch`` keeps the other workers alive (see ``docs/failures.md``). The ``join-*`` phases are
    steps of a restarted worker's admission, and ``N`` is then the restart count of the life in which it dies.
    """

    worker: tuple[int, int]
    """``[pipeline, stage]`` of the worker to kill."""
    iteration: int
    """0-based iteration in which it dies."""
    phase: FaultPhase = "forward"
    """Where in the iteration: F, B, W, the worker's last W, a send, a receive, the all-reduce, the optimizer
    step, idle, or a step of a restarted worker's admission (``join-*``)."""
    slow: float | None = None
    """Instead of a kill, a slow accelerator: from ``iteration`` on, each of the worker's F, B, W and optimizer
    steps lasts this many times as long (it sleeps the difference after each; CPU devices). ``phase`` is unused."""

    def __post_init__(self) -> None:
        if self.iteration < 0:
            raise ConfigError("recycle.faults[].iteration", f"{self.iteration} is negative", "use 0 or more")
        if self.slow is not None and not 1.0 <= self.slow <= 100.0:
            raise ConfigError("recycle.faults[].slow", f"{self.slow} is outside [1, 100]",
                              "give how many times slower the worker runs, e.g. 2.0")


@dataclass(frozen=True)
class FailSlowConfig:
    """Fail-slow: the job finds a worker persistently slower than its stage's peers and re-plans around it.

    Each member reports its seconds of F, B and W per micro-batch every iteration (CPU devices; one all-reduce of
    one number per worker, posted at an iteration boundary and read at the next); a worker whose median over
    ``window`` iterations is ``enter`` times its stage peers' median for ``confirm`` checks in a row is planned
    with that speed factor (its peers take some of its micro-batches, in their bubbles); back at ``leave`` or
    below, it is planned normal again. See ``ds_recycle.resilience.speed``.
    """

    enabled: bool = True
    """False: no measuring exchange and no re-planning for speed."""
    enter: float = 1.3
    """Ratio to the stage peers' pace at or above which a worker is slow."""
    leave: float = 1.15
    """Ratio at or below which a slow worker is normal again."""
    window: int = 7
    """Iterations whose ratios make up the median."""
    confirm: int = 4
    """Consecutive checks that must agree before the plan changes (with ``window`` 7: found within 8 iterations)."""

    def __post_init__(self) -> None:
        if not 1.0 < self.leave < self.enter:
            raise ConfigError("recycle.fail_slow.leave", f"leave={self.leave}, enter={self.enter}",
                              "use 1 < leave < enter (for example leave 1.15, enter 1.3)")
        if self.window < 1 or self.confirm < 1:
            raise ConfigError("recycle.fail_slow.window" if self.window < 1 else "recycle.fail_slow.confirm",
                              "is below 1", "use a positive number of iterations")


@dataclass(frozen=True)
class RepartitionConfig:
    """Lasting failures: move layers between stages so that every live worker's work evens out.

    Once a membership with absent workers (or a re-partitioned one that healed) has lasted ``after_iterations``
    iterations, the planner compares staying with the best partition of the layers for the live replicas
    (``ds_recycle.plan.partition``); the job moves the layers, from live holders, at an iteration boundary when the
    time saved over ``horizon`` iterations exceeds the transfer (its layers' parameters and Adam state at
    ``bandwidth_gbs``). A worker that rejoins gets the job's own partition back first. See
    ``ds_recycle.resilience.repartition``.
    """

    enabled: bool = True
    """False: failures are only re-routed (layers never move)."""
    after_iterations: int = 3
    """Iterations a membership must last before layers move (a failure healed sooner is only re-routed)."""
    horizon: int = 100
    """Iterations over which a move must pay for its transfer."""
    bandwidth_gbs: float = 1.0
    """Worker-to-worker bandwidth assumed for the move's cost, GB/s."""
    layer_costs_file: str | None = None
    """Per-layer F, B, W (and optionally O) in the units of ``costs_file``: one value per entry of the
    ``PipelineModule``'s layer list. Null: each stage's costs split evenly over its layers that hold parameters."""

    def __post_init__(self) -> None:
        if self.after_iterations < 1:
            raise ConfigError("recycle.repartition.after_iterations", f"{self.after_iterations} is below 1",
                              "give a number of iterations >= 1")
        if self.horizon < 1:
            raise ConfigError("recycle.repartition.horizon", f"{self.horizon} is below 1",
                              "give a number of iterations >= 1")
        if not self.bandwidth_gbs > 0:
            raise ConfigError("recycle.repartition.bandwidth_gbs", f"{self.bandwidth_gbs} is not positive",
                              "give GB/s > 0")


@dataclass(frozen=True)
class RecycleConfig:
    """The ``"recycle"`` section."""

    enabled: bool = True
    """False runs DeepSpeed's stock ``PipelineEngine`` on the same model and data (the baseline)."""
    stages: int = 2
    """Pipeline stages S."""
    pipelines: int = 2
    """Data-parallel pipelines D. The job has S x D workers."""
    schedule: Literal["1f1b", "zb-h1", "adaptive"] = "adaptive"
    """Failure-free schedule: DeepSpeed's 1F1B, zero-bubble ZB-H1, or the planner's choice."""
    optimizer_step: Literal["staggered", "synchronous"] = "staggered"
    """Each stage steps when its own work is done, or all stages step together."""
    transport: Literal["auto", "gloo", "nccl"] = "auto"
    """How boundary tensors and reductions travel between workers under failure handling. ``"nccl"``: NCCL
    communicators per membership epoch, aborted together and rebuilt among the survivors on a failure
    (``ds_recycle/resilience/nccl.py``); it needs a GPU of its own for every worker, and is refused at start
    otherwise. ``"gloo"``: gloo, on GPUs too, CUDA tensors staged through host memory (workers may share a GPU).
    ``"auto"``: NCCL where every worker has a GPU of its own and torch has NCCL, gloo elsewhere (CPU jobs, workers
    sharing a GPU). NCCL has not run on GPUs yet (README, "What has run on a GPU")."""
    nccl_shrink: bool = True
    """On NCCL, after a failure that only removes workers, cut the lost ranks out of the failed epoch's
    communicators (``ncclCommShrink``, NCCL 2.27 or later) instead of building the next epoch's afresh; where the
    NCCL build cannot shrink, or any survivor's shrink fails, they are built afresh. False: always afresh."""
    boundary_log: Literal["device", "pinned_host"] = "device"
    """Where the failure handler keeps the tensors each worker sent and received until no repair can ask for them
    (about one iteration of boundary tensors, ``engine/boundary_log.py``). ``"device"``: references to the tensors
    themselves, no copy, but on a GPU they hold device memory past W. ``"pinned_host"``: a copy in pinned host memory,
    made as each is sent or received (one device-to-host copy per boundary tensor, queued on the stream), for when
    device memory is scarce. The same on CPU."""
    deterministic: bool = True
    """On GPUs, torch's deterministic algorithms (``torch.use_deterministic_algorithms``): a micro-batch a peer
    computes again gives the same bits, and a run with failures ends at the failure-free model bit for bit. An op
    without a deterministic kernel then raises, naming itself. False leaves the setting as the script made it."""
    memory_limit: int | None = None
    """Most micro-batches whose activations one worker may hold; null: the planner's default."""
    assume_failed: tuple[Worker, ...] = ()
    """Workers ``[pipeline, stage]`` absent from the start (the job runs with that many fewer processes)."""
    costs_file: str | None = None
    """Cost profile (per-stage F, B, W, O and comm) for the planner; null: uniform costs until the job has
    measured its own (``measure_costs``)."""
    measure_costs: bool = True
    """Without ``costs_file``: once per membership epoch, after a few iterations, re-plan with the F, B, W and
    optimizer-step times the workers measured when that plan is at least 3% faster (CPU devices)."""
    faults: tuple[FaultConfig, ...] = ()
    """Failures to inject (fault injection for tests and the demo); ``--kill P:S@N:PHASE`` and ``--slow P:S@N*F``
    add more."""
    failure_timeout_s: float = 300.0
    """Longest any single wait (receive, send completion, all-reduce, norm) may last before the peer is
    declared failed. Crashed peers are detected within milliseconds from the launcher's exit reports, so
    this only bounds hangs: keep it well above the slowest legitimate wait (slow is not dead)."""
    heartbeat_stale_s: float = 10.0
    """A member whose heartbeat has not moved for this long is declared hung, even while its peers wait on it:
    the watchdog that reads it has its launcher fence it (SIGKILL), and the agreement counts it dead."""
    salvage: bool = True
    """After a failure, keep the weight gradients the survivors finished in the interrupted iteration and
    run only the rest of it (when possible); false: the stages that had not stepped it drop their partial sums
    and run their part of it again (stages that had stepped it run nothing again; nothing is restored)."""
    rng_seed: int = 0
    """Base seed of the per-micro-batch random streams: a micro-batch's forward (dropout) draws from a generator
    seeded by ``(rng_seed, step, pipeline, index, stage)``, so it gets the same masks wherever it runs."""
    fail_slow: FailSlowConfig = field(default_factory=FailSlowConfig)
    """Detection of slow workers and re-planning around them."""
    repartition: RepartitionConfig = field(default_factory=RepartitionConfig)
    """Moving layers between stages while a failure lasts."""
    model: GPTConfig = field(default_factory=GPTConfig)
    """The GPT to train."""
    data: DataConfig = field(default_factory=DataConfig)
    """The training data."""

    def __post_init__(self) -> None:
        if self.stages < 1 or self.pipelines < 1:
            raise ConfigError("recycle.stages" if self.stages < 1 else "recycle.pipelines",
                              f"stages={self.stages}, pipelines={self.pipelines}", "both must be at least 1")
        if self.memory_limit is not None and self.memory_limit < 1:
            raise ConfigError("recycle.memory_limit", f"{self.memory_limit} is below 1",
                              "use a positive number of micro-batches, or null")
        self._check_assume_failed()
        self._check_faults()

    def _check_faults(self) -> None:
        for i, f in enumerate(self.faults):
            d, s = f.worker
            if not (0 <= d < self.pipelines and 0 <= s < self.stages) or f.worker in self.assume_failed:
                raise ConfigError(f"recycle.faults[{i}].worker", f"[{d}, {s}] is not a live worker of this "
                                  f"{self.pipelines} x {self.stages} job", "give [pipeline, stage] of a live worker")
        if self.failure_timeout_s <= 0 or self.heartbeat_stale_s <= 0:
            raise ConfigError("recycle.failure_timeout_s" if self.failure_timeout_s <= 0 else
                              "recycle.heartbeat_stale_s", "must be positive", "give a number of seconds > 0")

    def _check_assume_failed(self) -> None:
        seen: set[Worker] = set()
        for i, (d, s) in enumerate(self.assume_failed):
            if not (0 <= d < self.pipelines and 0 <= s < self.stages):
                raise ConfigError(f"recycle.assume_failed[{i}]", f"[{d}, {s}] is outside {self.pipelines} pipelines"
                                  f" x {self.stages} stages", "give [pipeline, stage] with 0-based indices")
            if (d, s) in seen:
                raise ConfigError(f"recycle.assume_failed[{i}]", f"[{d}, {s}] is listed twice", "list it once")
            seen.add((d, s))
        for s in range(self.stages):
            if all((d, s) in seen for d in range(self.pipelines)):
                raise ConfigError("recycle.assume_failed", f"every worker of stage {s} is absent",
                                  "keep at least one live worker per stage (a whole lost stage needs a checkpoint)")

    @property
    def world_size(self) -> int:
        """Processes the job needs: every worker but the assumed-failed ones."""
        return self.stages * self.pipelines - len(self.assume_failed)


@dataclass(frozen=True)
class TrainConfig:
    """A whole config file: the typed ``recycle`` section and the DeepSpeed keys it relies on."""

    recycle: RecycleConfig
    deepspeed: dict[str, Any]
    """The DeepSpeed config as DeepSpeed will see it (``recycle`` and ``optimizer`` removed)."""
    optimizer_type: str
    optimizer_params: dict[str, Any]
    micro_batch_size: int
    micro_batches: int
    """Micro-batches per pipeline per iteration (DeepSpeed's gradient_accumulation_steps)."""
    gradient_clipping: float
    path: str = ""

    def check_world_size(self, world_size: int) -> None:
        """Fail when the launcher started a different number of processes than the config describes."""
        need = self.recycle.world_size
        if world_size != need:
            absent = f" minus {len(self.recycle.assume_failed)} assumed failed" if self.recycle.assume_failed else ""
            raise ConfigError("recycle.pipelines", f"{self.recycle.stages} stages x {self.recycle.pipelines} "
                              f"pipelines{absent} need {need} processes, but {world_size} were started",
                              f"launch {need} processes (--num_accelerators {need}) or change stages/pipelines")

    def resolved(self) -> dict[str, Any]:
        """The full resolved configuration, for the start-up log and the metrics."""
        return {"recycle": to_jsonable(self.recycle), "deepspeed": self.deepspeed,
                "optimizer": {"type": self.optimizer_type, "params": self.optimizer_params}}


def load_config(source: str | Path | dict[str, Any]) -> TrainConfig:
    """Parse and check a config file (or an already loaded dict)."""
    path = ""
    if not isinstance(source, dict):
        path = str(source)
        source = load_json_object(path)
    if not isinstance(source, dict):
        raise ConfigError("<top>", "the config is not a JSON object", "write the config as {...}")
    raw = dict(source)
    _check_top_level_keys(raw)
    recycle = parse_dataclass(RecycleConfig, raw.pop("recycle", {}), "recycle")
    if recycle.model.n_layer < recycle.stages:
        raise ConfigError("recycle.model.n_layer", f"{recycle.model.n_layer} blocks cannot fill {recycle.stages} "
                          "stages", f"use at least {recycle.stages} layers or fewer stages")
    opt_type, opt_params = _optimizer(raw.pop("optimizer", {"type": "AdamW", "params": {"lr": 1e-3}}))
    mbs, gas = _required_int(raw, "train_micro_batch_size_per_gpu"), _required_int(raw, "gradient_accumulation_steps")
    _check_batch(raw, recycle, mbs, gas)
    _check_deepspeed_features(raw, recycle)
    clip = raw.setdefault("gradient_clipping", 1.0)  # DeepSpeed's own default, made explicit
    if not isinstance(clip, (int, float)) or clip < 0:
        raise ConfigError("gradient_clipping", f"{clip!r} is not a non-negative number", "use 0.0 (off) or e.g. 1.0")
    raw.setdefault("steps_per_print", 10**9)
    return TrainConfig(recycle=recycle, deepspeed=raw, optimizer_type=opt_type, optimizer_params=opt_params,
                       micro_batch_size=mbs, micro_batches=gas, gradient_clipping=float(clip), path=path)


def _check_top_level_keys(raw: dict[str, Any]) -> None:
    """Refuse a top-level key that is neither DeepSpeed's nor ours (DeepSpeed would ignore it silently)."""
    known = DEEPSPEED_TOP_LEVEL_KEYS | {"recycle"}
    for key in raw:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"did you mean '{close[0]}'?" if close else "neither DeepSpeed 0.19.8 nor ds_recycle reads it"
            raise ConfigError(key, "unknown top-level key", f"remove it or correct it ({hint})")


def _required_int(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(key, f"{value!r} is missing or not a positive integer", f"set '{key}' to a positive integer")
    return value


def _check_batch(raw: dict[str, Any], recycle: RecycleConfig, mbs: int, gas: int) -> None:
    want = mbs * gas * recycle.pipelines
    got = raw.get("train_batch_size", want)
    if got != want:
        raise ConfigError("train_batch_size", f"{got!r} != train_micro_batch_size_per_gpu ({mbs}) x "
                          f"gradient_accumulation_steps ({gas}) x recycle.pipelines ({recycle.pipelines}) = {want}",
                          f"set train_batch_size to {want}, or change the factors so they multiply to it")
    raw["train_batch_size"] = want


def _check_deepspeed_features(raw: dict[str, Any], recycle: RecycleConfig) -> None:
    stage = raw.get("zero_optimization", {}).get("stage", 0)
    if stage != 0:
        raise ConfigError("zero_optimization.stage", f"{stage!r}: ZeRO partitions optimizer state over the replicas "
                          "a failure removes", "use stage 0")
    if raw.get("fp16", {}).get("enabled", False) and recycle.enabled:
        raise ConfigError("fp16.enabled", "fp16 needs dynamic loss scaling, which the ReCycle engine does not support",
                          "remove 'fp16' or set enabled to false (fp32)")
    if raw.get("bf16", {}).get("enabled", False) and recycle.enabled:
        raise ConfigError("bf16.enabled", "the built-in GPT trains in fp32 (bf16 is supported for your own "
                          "PipelineModule through ds_recycle.initialize)", "remove 'bf16' or set enabled to false (fp32)")


def _optimizer(block: Any) -> tuple[str, dict[str, Any]]:
    if not isinstance(block, dict) or set(block) - {"type", "params"}:
        raise ConfigError("optimizer", f"{block!r} is not {{'type': ..., 'params': {{...}}}}",
                          "write the optimizer as DeepSpeed does: {\"type\": \"AdamW\", \"params\": {\"lr\": 1e-3}}")
    kind = block.get("type", "AdamW")
    match = {o.lower(): o for o in OPTIMIZERS}.get(str(kind).lower())
    if match is None:
        raise ConfigError("optimizer.type", f"{kind!r} is not supported", f"use one of {', '.join(OPTIMIZERS)}")
    params = block.get("params", {})
    if not isinstance(params, dict):
        raise ConfigError("optimizer.params", f"{params!r} is not an object", "write params as {\"lr\": 1e-3, ...}")
    params = dict(params)
    params.pop("torch_adam", None)  # we always build torch's optimizer (no fused-op compilation)
    if "lr" not in params:
        raise ConfigError("optimizer.params.lr", "missing", "set a learning rate, e.g. \"lr\": 1e-3")
    return match, params
