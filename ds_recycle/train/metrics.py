"""Per-iteration metrics: a JSON Lines file and wandb, written by the one reporting rank.

JSON Lines record (one per iteration)::

    {"iter": 7, "loss": 2.91, "iter_time_s": 0.41, "tokens_per_s": 5012.3,
     "live_workers": 4, "rerouted_microbatches": 0, "events": [], "time_s": 3.2}

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
    for event in rec.get("events", ()):
        kind = event["kind"]
        row[f"events/{kind}"] = row.get(f"events/{kind}", 0) + 1
        for key, value in event.items():
            if key != "time_s" and isinstance(value, (int, float)) and not isinstance(value, bool):
                row[f"events/{kind}/{key}"] = value
    return row


class MetricsWriter:
    """Writes one record per iteration to JSON Lines (optional) and wandb (unless disabled)."""

    def __init__(self, path: str | None, tokens_per_iteration: int, run_config: dict[str, Any],
                 wandb_mode: str, run_name: str | None = None, project: str = "ds_recycle",
                 append: bool = False) -> None:
        """``append``: continue an existing file (a rank taking over from a reporter that died)."""
        self.tokens_per_iteration = tokens_per_iteration
        self.start = time.monotonic()
        self._file: TextIO | None = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a" if append else "w", encoding="utf-8")
        self._wandb: Any = None
        self._events: list[list[Any]] = []
        if wandb_mode != "disabled":
            import wandb

            self._wandb = wandb.init(project=project, name=run_name, config=run_config, mode=wandb_mode,  # type: ignore[arg-type]
                                     dir=os.environ.get("WANDB_DIR"))

    def record(self, iteration: int, result: IterationResult, iter_time_s: float,
               host_events: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
        """Write and return the record of one iteration; ``host_events`` (host lost, partitioned, back: recorded
        by the launchers, see ``ds_recycle.launcher.hostwatch``) join the iteration's events."""
        events = [*result.events, *host_events]
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
