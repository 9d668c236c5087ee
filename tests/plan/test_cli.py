from __future__ import annotations

import json

import pytest

from ds_recycle.cli import main
from ds_recycle.plan import validate_document


def test_cli_writes_plan_trace_and_picture(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    trace = tmp_path / "trace.json"
    png = tmp_path / "plan.png"
    rc = main(["plan", "--stages", "3", "--pipelines", "2", "--microbatches", "4", "--iterations", "2",
               "--fail", "1:1", "--costs", "1,1,1,0.5,0.05", "--json", str(out), "--trace", str(trace),
               "--png", str(png)])
    assert rc == 0
    text = capsys.readouterr().out
    for needle in ("time per iteration", "bubble fraction", "plan / bound", "plan / failure-free", "p0s1 |"):
        assert needle in text
    plan = validate_document(json.loads(out.read_text()))
    assert plan.failed == frozenset({(1, 1)})
    events = json.loads(trace.read_text())["traceEvents"]
    ops = [e for e in events if e["ph"] == "X"]
    assert len(ops) == sum(len(v) for v in plan.workers.values())
    assert all(e["dur"] >= 0 and "pid" in e and "tid" in e for e in ops)
    assert any(e["args"]["rerouted"] for e in ops)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_costs_file(tmp_path, capsys) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"F": [1, 2], "B": [1, 2], "W": [0.5, 1], "O": [0, 0], "comm": 0.1, "unit": "ms"}))
    assert main(["plan", "--stages", "2", "--pipelines", "2", "--microbatches", "3", "--costs-file", str(profile),
                 "--schedule", "zb-h1"]) == 0
    assert "zb-h1 plan" in capsys.readouterr().out
    assert main(["plan", "--stages", "3", "--pipelines", "2", "--microbatches", "3",
                 "--costs-file", str(profile)]) == 2
    assert "has 2 stages but --stages is 3" in capsys.readouterr().err


def test_cli_repartitions_with_layers(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "--stages", "4", "--pipelines", "4", "--microbatches", "8", "--fail", "0:1",
                 "--layers", "16", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "re-partition (16 layers a stage): move: [0, 16, 32, 48, 64] -> [0, 18, 30, 47, 64]" in text
    assert "(throughput kept 0.925" in text
    assert json.loads(out.read_text())["partition"] == [0, 18, 30, 47, 64]


@pytest.mark.parametrize("argv, message", [
    (["--fail", "1-2"], "expected PIPELINE:STAGE"),
    (["--costs", "1,1,1"], "expected five numbers"),
    (["--memory-limit", "0"], "expected an integer >= 1"),
    (["--schedule", "gpipe"], "invalid choice"),
])
def test_cli_rejects_malformed_arguments(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", "--stages", "3", "--pipelines", "2", "--microbatches", "4", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_reports_lost_stage(capsys) -> None:
    assert main(["plan", "--stages", "3", "--pipelines", "2", "--microbatches", "4",
                 "--fail", "0:1", "--fail", "1:1"]) == 2
    assert "fall back to the last checkpoint" in capsys.readouterr().err
