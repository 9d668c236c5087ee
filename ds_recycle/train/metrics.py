"""Per-iteration metrics: a JSON Lines file and wandb, written by the one reporting rank.

JSON Lines record (one per iteration)::

    {"iter": 7, "loss": 2.91, "iter_time_s": 0.41, "tokens_per_s": 5012.3,
     "live_workers": 4, "rerouted_microbatches": 0, "events": [], "time_s": 3.2}

``events`` holds each event's JSON form (:mod:`ds_recycle.events`; read them back with
:func:`ds_recycle.events.events_of` or :func:`ds_recycle.events.parse_event`).

wandb receives the same numbers under grouped names with units (:data:`WANDB_KEYS`), each event's count and
numeric details at its iteration, and a table of all events with their times at the end. wandb runs
offline unless ``WANDB_MODE`` or ``--wandb`` says otherwise; offline runs land in
``$WANDB_DIR/wandb/offline-run-*`` and can be uploaded later with ``wandb sync``.
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from ds_recycle.events import Event, parse_event
from ds_recycle.train.runner import IterationResult

logger = logging.getLogger(__name__)

__all__ = ["MetricsWriter", "WANDB_KEYS", "wandb_row"]

WANDB_KEYS: dict[str, str] = {
    "loss": "train/loss",
    "iter_time_s": "time/iteration(s)",
    "tokens_per_s": "throughput/tokens(1/s)",
    "live_workers": "resilience/live_workers",
    "rerouted_microbatches": "resilience/rerouted_microbatches",
}


def wandb_row(rec: dict[str, Any]) -> dict[str, float]:
    """What one metrics record logs to wandb: the numbers of :data:`WANDB_KEYS`, and per event kind its count
    (``events/<kind>``) and its numeric details (``events/<kind>/<field>``, e.g.
    ``events/recovered/failure_to_full_iteration_s``)."""
    row: dict[str, float] = {WANDB_KEYS[k]: rec[k] for k in WANDB_KEYS if rec.get(k) is not None}
    for raw in rec.get("events", ()):
        event = raw if isinstance(raw, Event) else parse_event(raw)
        row[f"events/{event.kind}"] = row.get(f"events/{event.kind}", 0) + 1
        for key, value in event.numbers().items():
            row[f"events/{event.kind}/{key}"] = value
    return row


class MetricsWriter:
    """Writes one record per iteration to JSON Lines (optional) and wandb (unless disabled)."""

    def __init__(self, path: str | None, tokens_per_iteration: int, run_config: dict[str, Any],
                 wandb_mode: str, run_name: str | None = None, project: str = "ds_recycle",
                 append: bool = False, takeover: bool = False) -> None:
        """``append``: continue an existing file (a job resumed from its checkpoint). ``takeover``: continue it as the
        rank that took over from a reporter that died; iterations the file already holds are not written again
        (this rank may finish an iteration the dead reporter had recorded), their events go with the next record."""
        self.tokens_per_iteration = tokens_per_iteration
        self.start = time.monotonic()
        self._file: TextIO | None = None
        self._recorded = -1
        """The last iteration the file holds when taking over (-1: none)."""
        self._carried: list[dict[str, Any]] = []
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            if takeover:
                self._recorded = _last_iteration(Path(path))
            self._file = open(path, "a" if append or takeover else "w", encoding="utf-8")
        self._wandb: Any = None
        self._events: list[list[Any]] = []
        if wandb_mode != "disabled":
            import wandb

            self._wandb = wandb.init(project=project, name=run_name, config=run_config, mode=wandb_mode,  # type: ignore[arg-type]
                                     dir=os.environ.get("WANDB_DIR"))

    def record(self, iteration: int, result: IterationResult, iter_time_s: float,
               host_events: Sequence[Event] = ()) -> dict[str, Any] | None:
        """Write and return the record of one iteration (events in their JSON form); ``host_events`` (host lost,
        partitioned, back: recorded by the launchers, see ``ds_recycle.launcher.hostwatch``) join the iteration's
        events. None: the file holds that iteration already (see ``takeover``)."""
        events = [e.to_dict() for e in (*result.events, *host_events)]
        if iteration <= self._recorded:
            self._carried += events
            return None
        events, self._carried = self._carried + events, []
        rec = {"iter": iteration, "loss": result.loss, "iter_time_s": iter_time_s,
               "tokens_per_s": self.tokens_per_iteration / iter_time_s if iter_time_s > 0 else None,
               "live_workers": result.live_workers, "rerouted_microbatches": result.rerouted_microbatches,
               "events": events, "time_s": time.monotonic() - self.start,
               "unix_time": time.time()}
        if self._file:
            self._file.write(json.dumps(rec) + "\n")
            self._file.flush()
        if self._wandb is not None:
            self._wandb.log(wandb_row(rec), step=iteration)
            self._events += [[iteration, e["kind"], e["time_s"], json.dumps(e)] for e in events]
        return rec

    def close(self, summary: dict[str, Any]) -> None:
        if self._file:
            self._file.close()
        if self._wandb is not None:
            if self._events:  # every event with its wall-clock time, as a table in the run
                import wandb

                self._wandb.log({"events/all": wandb.Table(columns=["iter", "kind", "time_s", "event"],
                                                           data=self._events)})
            for key, value in summary.items():
                self._wandb.summary[key] = value
            self._wandb.finish()


def _last_iteration(path: Path) -> int:
    """The iteration of the last complete record in a metrics file (-1: none, or no file)."""
    if not path.exists():
        return -1
    last = -1
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip().endswith("}"):
            last = int(json.loads(line)["iter"])
    return last
