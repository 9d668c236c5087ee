"""What the metrics writer sends to wandb, and that an offline wandb run accepts events."""
from __future__ import annotations

import json
from pathlib import Path

from ds_recycle.events import FailureEvent, RecoveredEvent
from ds_recycle.train.metrics import MetricsWriter, wandb_row
from ds_recycle.train.runner import IterationResult

EVENTS = (FailureEvent(time_s=1.0, lost_ranks=(1,), lost_workers=((1, 0),), reason="rank 1 exited", epoch=1),
          RecoveredEvent(time_s=2.0, failure_to_full_iteration_s=1.2, killed_at=0.5, detected_at=0.6,
                         detection_s=None, agreement_s=0.1, regroup_s=0.1, plan_lookup_s=0.0, restore_s=0.1,
                         redo_s=0.8, repair_iteration=3, committed_stages=(), dropped_stages=(),
                         kept_weight_gradients=2, tensors_from_logs=0, rolled_forward_bytes=0, completed_steps=0))


def _rec() -> dict:
    return {"iter": 3, "loss": 2.5, "iter_time_s": 0.5, "tokens_per_s": 100.0, "live_workers": 3,
            "rerouted_microbatches": 4, "events": [e.to_dict() for e in EVENTS]}


def test_wandb_row_carries_numbers_and_events() -> None:
    row = wandb_row(_rec())
    assert row["train/loss"] == 2.5 and row["resilience/live_workers"] == 3
    assert row["events/failure"] == 1 and row["events/failure/epoch"] == 1
    assert row["events/recovered/failure_to_full_iteration_s"] == 1.2
    assert "events/recovered/detection_s" not in row and "events/failure/time_s" not in row
    assert "events/rejoin" not in row


def test_offline_run_with_events_and_appending_file(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    path = tmp_path / "m.jsonl"
    result = IterationResult(2.5, 3, 4, EVENTS)
    writer = MetricsWriter(str(path), 100, {"x": 1}, "offline", run_name="t")
    writer.record(3, result, 0.5)
    writer.close({"final_loss": 2.5})
    # A new reporter continues the file; it may finish an iteration the dead one recorded (it was still waiting
    # for that iteration's loss): not written twice, its events go with the next record.
    taker = MetricsWriter(str(path), 100, {"x": 1}, "disabled", takeover=True)
    assert taker.record(3, IterationResult(None, 3, 4, EVENTS[:1]), 0.5) is None
    taker.record(4, IterationResult(2.4, 3, 4, EVENTS[1:]), 0.5)
    taker.close({})
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["iter"] for r in records] == [3, 4] and records[0]["events"][1]["kind"] == "recovered"
    assert records[0]["events"] == [e.to_dict() for e in EVENTS]  # the events' JSON form, as written
    assert [e["kind"] for e in records[1]["events"]] == ["failure", "recovered"]
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
