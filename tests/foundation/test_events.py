"""The event schema: one definition per kind, read back strictly, worded truthfully, and the docs table generated
from it."""
from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest

from ds_recycle import events as ev

DOCS = Path(__file__).resolve().parents[2] / "docs" / "failures.md"


def _sample(cls: type[ev.Event]) -> ev.Event:
    """An event of ``cls`` with a value of the right type in every field."""
    by_type: dict[object, object] = {float: 1.5, float | None: 2.5, bool: True, int: 3, str: "x",
                                     tuple[int, ...]: (2, 3), tuple[tuple[int, int], ...]: ((1, 0),),
                                     tuple[str, ...]: ("p2p", "norm"),
                                     tuple[int, int]: (1, 2), int | None: 4,
                                     tuple[tuple[int, int, float], ...]: ((1, 2, 2.5),)}
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: by_type[hints[f.name]] for f in dataclasses.fields(cls)})


@pytest.mark.parametrize("kind", list(ev.event_kinds()))
def test_every_kind_survives_its_json_form(kind: str) -> None:
    event = _sample(ev.event_kinds()[kind])
    raw = json.loads(json.dumps(event.to_dict()))
    assert raw["kind"] == kind and ev.parse_event(raw) == event


def test_a_record_that_does_not_fit_its_definition_is_refused_by_name() -> None:
    recovered = _sample(ev.RecoveredEvent).to_dict()
    old = {**{k: v for k, v in recovered.items() if k != "repair_iteration"}, "redo_iteration": 3, "salvaged": True}
    with pytest.raises(ev.EventError, match=r"unknown fields \['redo_iteration', 'salvaged'\].*'repair_iteration'"):
        ev.parse_event(old)
    with pytest.raises(ev.EventError, match="unknown event kind 'crash'.*failure"):
        ev.parse_event({"kind": "crash", "time_s": 1.0})
    with pytest.raises(ev.EventError, match="'lost_ranks': expected a list"):
        ev.parse_event({**_sample(ev.FailureEvent).to_dict(), "lost_ranks": 2})


def test_events_of_reads_records_and_lives() -> None:
    failure, rejoin = _sample(ev.FailureEvent), _sample(ev.RejoinEvent)
    records = [{"iter": 0, "events": [failure.to_dict()]}, {"iter": 1, "events": [rejoin.to_dict(), failure]}]
    assert ev.events_of(records, ev.FailureEvent) == [failure, failure]
    assert ev.events_of([records[:1], records[1:]], ev.RejoinEvent) == [rejoin]
    assert ev.events_of([], ev.RejoinEvent) == []


def test_a_recovery_says_what_became_of_the_interrupted_iteration() -> None:
    base = dataclasses.replace(_sample(ev.RecoveredEvent), repair_iteration=12, committed_stages=(),
                               dropped_stages=(), kept_weight_gradients=0, tensors_from_logs=0, completed_steps=0)
    assert not base.salvaged and "redone from its start" in base.describe()
    kept = dataclasses.replace(base, kept_weight_gradients=3, committed_stages=(1,))
    assert kept.salvaged and "iteration 12 repaired (3 weight gradients kept, stages [1] had stepped it" in kept.describe()


def test_wandb_numbers_leave_out_time_flags_and_unknowns() -> None:
    numbers = _sample(ev.ResumedEvent).numbers()
    assert numbers == {"iteration": 3.0, "generation": 3.0}  # not time_s, not the bool, not the directory


def test_the_docs_table_is_the_generated_one() -> None:
    text = DOCS.read_text(encoding="utf-8")
    start = text.index("\n", text.index("<!-- events:begin")) + 1
    table = text[start:text.index("<!-- events:end -->")]
    assert table == ev.events_markdown(), ("docs/failures.md's events table is out of date: replace it with the "
                                           "output of `python -m ds_recycle.events`")
    for kind in ev.event_kinds():
        assert f"| `{kind}` |" in table
