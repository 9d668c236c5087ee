"""Every event ds_recycle records, one frozen, typed definition per kind.

Workers (the failure handler) and launchers (host events) build these; the metrics file, wandb, the demo,
the benchmarks and the goodput tools read them back through :func:`parse_event`. An event travels as a
JSON object: ``{"kind": ..., "time_s": ..., <its fields>}`` (:meth:`Event.to_dict`). Reading one checks its
kind and its fields against the definition, so a renamed field fails where it is read, with the name, not
as a ``KeyError`` three modules later.

The table in ``docs/failures.md`` is generated from these definitions (``python -m ds_recycle.events``
prints it; ``tests/foundation/test_events.py`` checks that the docs hold exactly that table).

Pure Python: no torch, nothing of ds_recycle imported.
"""
from __future__ import annotations

import dataclasses
import sys
import time
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

__all__ = [
    "AgreementEvent", "CheckpointEvent", "Event", "EventError", "FailureEvent", "FallbackEvent", "HostBackEvent", "HostEvent",
    "HostLostEvent", "HostPartitionedEvent", "PlanSwitchEvent", "RecoveredEvent", "RejoinEvent", "RepartitionEvent",
    "ResumedEvent",
    "RollForwardEvent", "SlowWorkerEvent", "StageLostEvent", "event_kinds", "events_markdown", "events_of", "parse_event",
]

Pair = tuple[int, int]
"""A worker: ``(pipeline, stage)``."""


class EventError(ValueError):
    """A record is not an event of a known kind with exactly that kind's fields."""


def _doc(text: str, default: Any = dataclasses.MISSING) -> Any:
    """A field with its documentation (the docs table is built from it)."""
    if default is dataclasses.MISSING:
        return field(metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


_KINDS: dict[str, type[Event]] = {}


@dataclass(frozen=True, kw_only=True)
class Event:
    """One thing that happened to the job (subclasses are the kinds)."""

    KIND: ClassVar[str] = ""
    SOURCE: ClassVar[str] = "worker"
    """Who records it: ``worker`` (the failure handler of each survivor) or ``launcher``."""

    time_s: float = field(default_factory=time.time, metadata={"doc": "wall clock, Unix seconds"})

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.KIND:
            if cls.KIND in _KINDS:
                raise TypeError(f"event kind {cls.KIND!r} is defined twice ({_KINDS[cls.KIND].__name__}, {cls.__name__})")
            _KINDS[cls.KIND] = cls

    @property
    def kind(self) -> str:
        return self.KIND

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: ``kind``, ``time_s``, then the fields in definition order (tuples as lists)."""
        out: dict[str, Any] = {"kind": self.KIND}
        for f in dataclasses.fields(self):
            out[f.name] = _jsonable(getattr(self, f.name))
        return out

    def numbers(self) -> dict[str, float]:
        """The numeric fields (booleans and ``time_s`` excluded), for wandb."""
        return {f.name: float(v) for f in dataclasses.fields(self) if f.name != "time_s"
                for v in (getattr(self, f.name),) if isinstance(v, (int, float)) and not isinstance(v, bool)}

    def describe(self) -> str:
        """One line for a person reading a run as it goes."""
        details = ", ".join(f"{f.name}={_jsonable(getattr(self, f.name))}" for f in dataclasses.fields(self)
                            if f.name != "time_s")
        return f"{self.KIND}: {details}"


# ---------------------------------------------------------------------------------------------- failure path
@dataclass(frozen=True, kw_only=True)
class FailureEvent(Event):
    """Members of the epoch were found dead (their launcher reported them, or their heartbeat stopped)."""

    KIND: ClassVar[str] = "failure"
    lost_ranks: tuple[int, ...] = _doc("the ranks gone")
    lost_workers: tuple[Pair, ...] = _doc("their workers")
    reason: str = _doc("the wait or check that saw the failure, and the watchdog's finding")
    epoch: int = _doc("the membership epoch that begins (one per failure handled)")

    def describe(self) -> str:
        return f"FAILURE: lost worker(s) {_jsonable(self.lost_workers)} ({self.reason[:60]})"


@dataclass(frozen=True, kw_only=True)
class AgreementEvent(Event):
    """The survivors agreed on the new members and on the iteration to repair."""

    KIND: ClassVar[str] = "agreement"
    members: tuple[int, ...] = _doc("the agreed live ranks")
    epoch: int = _doc("the membership epoch")
    repair_iteration: int = _doc("the interrupted iteration, repaired rather than redone")
    committed_stages: tuple[int, ...] = _doc("stages that had stepped it (they run nothing of it again)")


@dataclass(frozen=True, kw_only=True)
class PlanSwitchEvent(Event):
    """A new plan runs from this iteration on (after a failure, a rejoin, or a change of a worker's speed)."""

    KIND: ClassVar[str] = "plan_switch"
    absent: tuple[Pair, ...] = _doc("the failure set of the new plan")
    rerouted: int = _doc("(stage, micro-batch) pairs per iteration run by a worker of another pipeline")
    slow: tuple[tuple[int, int, float], ...] = _doc(
        "the slow workers the plan assumes, `[pipeline, stage, speed factor]` (empty: every live worker normal)", ())
    iteration: int | None = _doc("the first iteration it runs (None: the repaired one after a failure)", None)
    measured: bool = _doc("made from the costs the job measured (false: the configured costs)", False)

    def describe(self) -> str:
        slow = f", slow {_jsonable(self.slow)}" if self.slow else ""
        measured = ", measured costs" if self.measured else ""
        return (f"plan switch: absent {_jsonable(self.absent)}{slow}{measured}, {self.rerouted} re-routed micro-batch "
                "steps")


@dataclass(frozen=True, kw_only=True)
class RepartitionEvent(Event):
    """Layers moved between stages at an iteration boundary (a failure that lasts, or back after a rejoin)."""

    KIND: ClassVar[str] = "repartition"
    iteration: int = _doc("the first iteration run on the new partition")
    before: tuple[int, ...] = _doc("layer boundaries before (DeepSpeed's `PipelineModule.parts`)")
    after: tuple[int, ...] = _doc("layer boundaries from this iteration on")
    absent: tuple[Pair, ...] = _doc("the failure set the partition was chosen for")
    layers_moved: int = _doc("layers that changed stage")
    bytes_received: int = _doc("bytes of layer state this worker received")
    move_s: float = _doc("seconds the move took on this worker (the pause of the iteration boundary)")
    planned_before: float | None = _doc("planned time per iteration on the old partition (the plan's units; None: "
                                        "a move back, before a rejoin or a checkpoint)", None)
    planned_after: float | None = _doc("planned time per iteration on the new partition (the plan's units)", None)

    def describe(self) -> str:
        planned = "" if self.planned_before is None or self.planned_after is None else \
            f", planned {self.planned_before:.4g} -> {self.planned_after:.4g} per iteration"
        return (f"re-partition at iteration {self.iteration}: {_jsonable(self.before)} -> {_jsonable(self.after)} "
                f"(absent {_jsonable(self.absent)}), {self.layers_moved} layers moved in {self.move_s:.3f} s{planned}")


@dataclass(frozen=True, kw_only=True)
class SlowWorkerEvent(Event):
    """A live worker was found persistently slower than its stage's peers, or faster again (fail-slow)."""

    KIND: ClassVar[str] = "worker_speed"
    worker: Pair = _doc("the worker")
    rank: int = _doc("its rank")
    factor: float = _doc("the speed factor plans assume for it from now on (1.0: normal again)")
    previous: float = _doc("the factor assumed before")
    ratio: float = _doc("its measured pace over its stage peers' median (median of the detector's window)")
    iteration: int = _doc("the iteration boundary at which it was decided")

    def describe(self) -> str:
        if self.factor == 1.0:
            return f"worker {_jsonable(self.worker)} is back to normal speed (ratio {self.ratio:.2f})"
        return f"SLOW: worker {_jsonable(self.worker)} runs {self.ratio:.2f}x its peers' time: planned as {self.factor}x"


@dataclass(frozen=True, kw_only=True)
class RecoveredEvent(Event):
    """The first full iteration after a failure finished; the time it took, phase by phase."""

    KIND: ClassVar[str] = "recovered"
    failure_to_full_iteration_s: float = _doc(
        "from the kill (or from detection when the kill time is unknown) to the end of the first full iteration")
    killed_at: float | None = _doc("Unix time of the injected kill (None: not injected, unknown)")
    detected_at: float = _doc("Unix time at which this worker saw the failure")
    detection_s: float | None = _doc("`detected_at - killed_at` (None: kill time unknown)")
    agreement_s: float = _doc("agreeing on the members")
    regroup_s: float = _doc("building the new epoch's groups")
    plan_lookup_s: float = _doc("taking the plan for the new failure set")
    restore_s: float = _doc("deciding the repair and installing epoch, plan and repair in the engine")
    redo_s: float = _doc("running the repaired iteration")
    repair_iteration: int = _doc("the interrupted iteration")
    committed_stages: tuple[int, ...] = _doc("stages that had stepped it")
    dropped_stages: tuple[int, ...] = _doc("stages whose partial sums were dropped (their part is run again)")
    kept_weight_gradients: int = _doc("(stage, micro-batch) weight gradients kept from before the failure")
    tensors_from_logs: int = _doc("boundary tensors served from boundary logs")
    rolled_forward_bytes: int = _doc("stage state sent to a replica caught between reduction and step")
    completed_steps: int = _doc("replicas that only had the step left and took it in the repair")
    shrunk_groups: tuple[str, ...] = _doc("NCCL: the new epoch's groups taken shrunk from the failed epoch's (p2p, "
                                          "norm, stage, a tied weight's name); empty: every group built afresh", ())

    @property
    def salvaged(self) -> bool:
        """Something of the interrupted iteration was kept (gradients, committed stages or finished steps)."""
        return bool(self.kept_weight_gradients or self.committed_stages or self.completed_steps
                    or self.tensors_from_logs)

    def repair_summary(self) -> str:
        """What became of the interrupted iteration, in words."""
        if not self.salvaged:
            return f"in-flight iteration {self.repair_iteration} redone from its start (nothing of it kept)"
        parts = [f"{self.kept_weight_gradients} weight gradients kept"]
        if self.committed_stages:
            parts.append(f"stages {list(self.committed_stages)} had stepped it")
        if self.completed_steps:
            parts.append(f"{self.completed_steps} step(s) completed")
        if self.tensors_from_logs:
            parts.append(f"{self.tensors_from_logs} tensors from boundary logs")
        if self.dropped_stages:
            parts.append(f"stages {list(self.dropped_stages)} redone")
        return f"in-flight iteration {self.repair_iteration} repaired ({', '.join(parts)})"

    def describe(self) -> str:
        return (f"recovered: failure -> first full iteration {self.failure_to_full_iteration_s:.2f} s; "
                f"{self.repair_summary()}")


@dataclass(frozen=True, kw_only=True)
class RollForwardEvent(Event):
    """A replica caught between its stage's reduction and step got the state of one that had stepped."""

    KIND: ClassVar[str] = "roll_forward"
    stage: int = _doc("the stage")
    source: int = _doc("the rank that sent its state")
    iteration: int = _doc("the iteration it had stepped")
    state_bytes: int = _doc("bytes moved")


@dataclass(frozen=True, kw_only=True)
class RejoinEvent(Event):
    """Restarted workers joined the running job at an iteration boundary."""

    KIND: ClassVar[str] = "rejoin"
    ranks: tuple[int, ...] = _doc("the ranks that joined")
    workers: tuple[Pair, ...] = _doc("their workers")
    iteration: int = _doc("the boundary: the first iteration they train")
    members: tuple[int, ...] = _doc("every member from then on")
    join_s: float = _doc("from the boundary check (joiner: from its request) to the state loaded")
    regroup_s: float | None = _doc("building the join's groups (None on the joiner)", None)
    state_bytes: int = _doc("stage state moved through this rank: sent, received, or 0 in a stage that gained none")

    def describe(self) -> str:
        return f"REJOIN: worker(s) {_jsonable(self.workers)} back at iteration {self.iteration}"


@dataclass(frozen=True, kw_only=True)
class StageLostEvent(Event):
    """Every replica of a stage is gone and there is no checkpoint to fall back to: the survivors leave."""

    KIND: ClassVar[str] = "stage_lost"
    reason: str = _doc("why re-routing is impossible")


@dataclass(frozen=True, kw_only=True)
class FallbackEvent(Event):
    """Re-routing or repair is impossible: the whole job restarts from its latest checkpoint."""

    KIND: ClassVar[str] = "fallback"
    reason: str = _doc("why re-routing or repair is impossible")
    generation: int = _doc("the job's generation after the fallback (one per fallback)")
    directory: str = _doc("the checkpoint directory it falls back to")


@dataclass(frozen=True, kw_only=True)
class CheckpointEvent(Event):
    """Every stage's state is written and `latest` points at it."""

    KIND: ClassVar[str] = "checkpoint"
    next_iteration: int = _doc("the iteration training resumes at from it")
    directory: str = _doc("where it was written")


@dataclass(frozen=True, kw_only=True)
class ResumedEvent(Event):
    """Training resumed from a checkpoint (after a fallback, or a manual `--resume`)."""

    KIND: ClassVar[str] = "resumed"
    iteration: int = _doc("the iteration training resumes at (0: no checkpoint found)")
    generation: int = _doc("the job's generation")
    directory: str = _doc("the checkpoint directory")
    checkpoint_found: bool = _doc("false when the directory held no checkpoint")


# ---------------------------------------------------------------------------------------------- hosts
@dataclass(frozen=True, kw_only=True)
class HostEvent(Event):
    """What every host event says of its node (the kinds below)."""

    SOURCE: ClassVar[str] = "launcher"
    node: int = _doc("the node (launcher) index")
    host: str = _doc("its host name")
    ranks: tuple[int, ...] = _doc("the ranks it runs")


@dataclass(frozen=True, kw_only=True)
class HostLostEvent(HostEvent):
    """The store's host declared a node lost: its launcher's heartbeat stopped for `--node_timeout`."""

    KIND: ClassVar[str] = "host_lost"
    silent_s: float = _doc("how long its heartbeat had been silent")
    marked_lost: tuple[int, ...] = _doc("ranks given exit code 75 on its behalf")
    node_timeout_s: float = _doc("the launcher's `--node_timeout`")


@dataclass(frozen=True, kw_only=True)
class HostPartitionedEvent(HostEvent):
    """A launcher cut off from the store fenced its own workers (recorded once it reaches the store again)."""

    KIND: ClassVar[str] = "host_partitioned"
    cut_off_s: float = _doc("from the store's last answer to its next one")
    fenced_at: float | None = _doc("Unix time at which it killed its workers (None: it did not need to)")


@dataclass(frozen=True, kw_only=True)
class HostBackEvent(HostEvent):
    """A node's launcher is back (after a partition or a host restart) and restarted its ranks."""

    KIND: ClassVar[str] = "host_back"
    restarted_ranks: tuple[int, ...] = _doc("ranks it started again")
    after: str = _doc("`partition` or `host restart`")


# ---------------------------------------------------------------------------------------------- reading
E = TypeVar("E", bound=Event)


def event_kinds() -> dict[str, type[Event]]:
    """Every kind and its definition, in definition order."""
    return dict(_KINDS)


def parse_event(raw: Mapping[str, Any]) -> Event:
    """The event a JSON object describes; :class:`EventError` names the kind or field that does not fit."""
    if not isinstance(raw, Mapping):
        raise EventError(f"an event is a JSON object, not {type(raw).__name__}: {raw!r}")
    kind = raw.get("kind")
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise EventError(f"unknown event kind {kind!r}; known kinds: {', '.join(_KINDS)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    extra = sorted(set(raw) - set(fields) - {"kind"})
    missing = sorted(name for name, f in fields.items() if name not in raw
                     and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    if extra or missing:
        raise EventError(f"event {kind!r} does not match its definition ({cls.__name__} in ds_recycle.events): "
                         f"unknown fields {extra}, missing fields {missing}")
    values: dict[str, Any] = {}
    for name, value in raw.items():
        if name == "kind":
            continue
        try:
            values[name] = _convert(value, hints[name])
        except (TypeError, ValueError) as e:
            raise EventError(f"event {kind!r}, field {name!r}: {e}") from None
    return cls(**values)


def events_of(lives: Any, kind: type[E]) -> list[E]:
    """Every event of type ``kind`` in metrics records (one list of records per job life, or one list), in order.

    A record's ``events`` hold JSON objects (read from a metrics file) or events; each is read through
    :func:`parse_event`.
    """
    records = [r for life in lives for r in life] if lives and isinstance(lives[0], (list, tuple)) else list(lives)
    out: list[E] = []
    for rec in records:
        for raw in rec.get("events", ()) or ():
            event = raw if isinstance(raw, Event) else parse_event(raw)
            if isinstance(event, kind):
                out.append(event)
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


def _convert(value: Any, hint: Any) -> Any:
    """``value`` (from JSON) as ``hint`` says: tuples from lists, ints and floats checked, None where allowed."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None:
            if type(None) in options:
                return None
            raise TypeError("is null")
        return _convert(value, next(o for o in options if o is not type(None)))
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"expected a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0]) for v in value)
        if len(value) != len(args):
            raise TypeError(f"expected {len(args)} items, got {value!r}")
        return tuple(_convert(v, a) for v, a in zip(value, args))
    if hint is bool:
        if not isinstance(value, bool):
            raise TypeError(f"expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise TypeError(f"expected a string, got {value!r}")
        return value
    raise TypeError(f"no conversion to {hint!r}")


# ---------------------------------------------------------------------------------------------- the docs table
def _type_name(hint: Any) -> str:
    text = str(hint).replace("typing.", "").replace("ds_recycle.events.", "")
    text = text.replace("tuple[tuple[int, int], ...]", "list of [pipeline, stage]").replace(
        "tuple[int, ...]", "list of int").replace("tuple[str, ...]", "list of str").replace("NoneType", "None")
    text = text.replace("<class '", "").replace("'>", "")
    return text.replace(" | ", " or ")  # a bar would split the Markdown table's cell


def events_markdown() -> str:
    """The events table of ``docs/failures.md``: one row per kind, its fields with their types and meaning."""
    rows = ["| kind | recorded by | what happened | fields |", "|---|---|---|---|"]
    for kind, cls in _KINDS.items():
        hints = typing.get_type_hints(cls)
        fields = "; ".join(f"`{f.name}` ({_type_name(hints[f.name])}): {f.metadata.get('doc', '')}"
                           for f in dataclasses.fields(cls) if f.name != "time_s")
        summary = " ".join((cls.__doc__ or "").split())
        rows.append(f"| `{kind}` | {cls.SOURCE} | {summary} | {fields} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(events_markdown())
