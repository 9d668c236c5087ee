"""Goodput arithmetic over the reporter's metrics records of one job (pure functions, no processes).

A job's records come in *lives* (see :class:`ds_recycle.tools.jobs.MetricsTail`): a vanilla DeepSpeed job
lives from one (re)start to the failure that kills it; a ds_recycle job has one life unless it fell back to a
checkpoint. Each record says the iteration ``iter`` finished at ``unix_time``.

* **committed** at the end of a window: the iterations the model holds then. While the last life runs, that is
  its last finished iteration + 1; when the job is down (killed and not yet restarted, or restarted but not
  past start-up), it is the iteration of the latest checkpoint, which is where the next life resumes.
* **finished**: every iteration some life finished. **lost** = finished - committed: the iterations done
  again (or to be done again) because a failure rolled the job back.
* **goodput** = committed x tokens per iteration / window.
"""
from __future__ import annotations

import json
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ds_recycle.events import FallbackEvent, parse_event

__all__ = ["Failure", "parse_failures", "Progress", "progress", "steady_rate", "checkpoint_cost", "latest_checkpoint",
           "fallback_times"]

Record = Mapping[str, Any]


@dataclass(frozen=True)
class Failure:
    """One planned failure: SIGKILL worker (pipeline, stage) ``offset_s`` seconds after the job's launch."""

    offset_s: float
    pipeline: int
    stage: int

    def __str__(self) -> str:
        return f"{self.offset_s:g}:{self.pipeline}:{self.stage}"


def parse_failures(text: str, stages: int, pipelines: int) -> list[Failure]:
    """``"45:1:0,90:1:1"`` (seconds:pipeline:stage, comma-separated) as failures sorted by time.

    Worker (0, stages-1) reports the metrics of both systems' jobs and must stay alive.
    """
    failures = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        fields = item.split(":")
        try:
            offset, pipeline, stage = float(fields[0]), int(fields[1]), int(fields[2])
            if len(fields) != 3:
                raise ValueError
        except (ValueError, IndexError):
            raise ValueError(f"--failures item {item!r}: write SECONDS:PIPELINE:STAGE, e.g. 45:1:0") from None
        if offset <= 0 or not (0 <= pipeline < pipelines and 0 <= stage < stages):
            raise ValueError(f"--failures item {item!r}: need seconds > 0, pipeline in 0..{pipelines - 1}, "
                             f"stage in 0..{stages - 1}")
        if (pipeline, stage) == (0, stages - 1):
            raise ValueError(f"--failures item {item!r}: worker (0, {stages - 1}) reports the metrics; "
                             f"pick another victim")
        failures.append(Failure(offset, pipeline, stage))
    if not failures:
        raise ValueError(f"--failures {text!r}: give at least one SECONDS:PIPELINE:STAGE")
    return sorted(failures, key=lambda f: f.offset_s)


@dataclass(frozen=True)
class Progress:
    """What a job achieved in the window."""

    committed: int
    """Iterations the model holds at the end of the window."""
    finished: int
    """Iterations finished by any life (some later rolled back)."""
    lives: int
    """Number of (re)starts of the whole job that recorded at least one iteration."""

    @property
    def lost(self) -> int:
        """Iterations finished but rolled back by failures."""
        return self.finished - self.committed


def progress(lives: Sequence[Sequence[Record]], running: bool, checkpoint: int) -> Progress:
    """Progress at the end of a window.

    ``lives[-1]`` is the job's current life (empty if it has recorded nothing yet); ``running``: the process
    that writes its records is still alive, so its in-memory model counts; ``checkpoint``: the iteration of
    the latest checkpoint (0 if none), where a job that is down resumes.
    """
    finished = sum(len(life) for life in lives)
    if running and lives and lives[-1]:
        committed = int(lives[-1][-1]["iter"]) + 1
    else:
        committed = checkpoint
    if committed > finished:
        raise ValueError(f"committed {committed} > finished {finished}: the records miss iterations (a metrics "
                         f"file written anew before it was read?)")
    return Progress(committed, finished, sum(1 for life in lives if life))


def steady_rate(records: Sequence[Record], before: float | None = None) -> float | None:
    """Iterations per second of an uninterrupted stretch (checkpoints included), the first iteration left out.

    ``before``: use only records finished before this Unix time (e.g. the first failure).
    """
    kept = [r for r in records if before is None or r["unix_time"] < before][1:]
    if len(kept) < 2:
        return None
    return (len(kept) - 1) / (kept[-1]["unix_time"] - kept[0]["unix_time"])


def checkpoint_cost(records: Sequence[Record], interval: int) -> float | None:
    """Seconds a checkpoint adds to an iteration, as the reporter sees it.

    For each record after the first, the time outside the training step is the gap between two records minus
    the step's own time; the cost is the median of those gaps after a checkpoint iteration minus the median of
    the others. None without both kinds.
    """
    if interval <= 0:
        return None
    after: list[float] = []
    other: list[float] = []
    for prev, rec in zip(records, records[1:]):
        if rec["iter"] != prev["iter"] + 1:
            continue
        gap = rec["unix_time"] - prev["unix_time"] - rec["iter_time_s"]
        (after if (prev["iter"] + 1) % interval == 0 else other).append(gap)
    if not after or not other:
        return None
    return statistics.median(after) - statistics.median(other)


def latest_checkpoint(latest_text: str | None) -> int:
    """The iteration named by a checkpoint directory's ``latest`` file (``"iter15"``); 0 when there is none."""
    if latest_text is None or not latest_text.strip():
        return 0
    text = latest_text.strip()
    if not text.startswith("iter") or not text[4:].isdigit():
        raise ValueError(f"checkpoint 'latest' holds {text!r}; expected 'iter<N>'")
    return int(text[4:])


_EVENT_LINE = re.compile(r"\bevent (\{.*\})\s*$", re.MULTILINE)


def fallback_times(log_text: str) -> list[float]:
    """Unix times of the ``fallback`` events the workers logged (``event {...}`` lines of a ds_recycle job's log,
    each event's JSON form, read through :func:`ds_recycle.events.parse_event`): a whole stage was lost and the job
    went back to its checkpoint. The survivors leave right after, so the event may never reach the metrics file."""
    events = [parse_event(json.loads(m.group(1))) for m in _EVENT_LINE.finditer(log_text)]
    kept: list[float] = []
    for t in sorted(e.time_s for e in events if isinstance(e, FallbackEvent)):
        if not kept or t - kept[-1] > 1.0:  # each survivor logs the same fallback within a second
            kept.append(t)
    return kept
