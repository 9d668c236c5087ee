"""The pieces: ledger accounting, batch distribution, group spreading, models, report, pictures, CLI."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_recycle.cli import main
from ds_recycle.cluster.ledger import CheckpointPolicy, Ledger, Phase
from ds_recycle.cluster.models import MODELS, get_model, stage_layers
from ds_recycle.cluster.report import format_table, to_json
from ds_recycle.cluster.simulator import simulate
from ds_recycle.cluster.systems import SystemKind, distribute_batch, parse_systems
from ds_recycle.cluster.timing import JobShape, PipelineTimer, _spread
from ds_recycle.cluster.trace import parse_trace
from ds_recycle.cluster.workload import Workload, workload_from_model

from .conftest import SHAPE


def test_ledger_checkpoints_and_rollback() -> None:
    ledger = Ledger(full_rate=10.0, checkpoint=CheckpointPolicy(interval_s=100.0, cost_s=5.0))
    ledger.set_rate(10.0, 1.0)
    ledger.advance(250.0)  # train 0-100, ckpt -105, train -205, ckpt -210, train -250
    phases = [(s.phase, round(s.start_s), round(s.end_s)) for s in ledger.segments]
    assert phases == [(Phase.TRAINING, 0, 100), (Phase.CHECKPOINTING, 100, 105),
                      (Phase.TRAINING, 105, 205), (Phase.CHECKPOINTING, 205, 210),
                      (Phase.TRAINING, 210, 250)]
    assert ledger.rollback() == pytest.approx(40.0)
    assert ledger.segments[-1].phase is Phase.LOST


def test_ledger_inflight_loss_counts_from_the_stretch() -> None:
    ledger = Ledger(full_rate=10.0, checkpoint=None)
    ledger.set_rate(10.0, 3.0)
    ledger.advance(10.0)
    assert ledger.lose_inflight() == pytest.approx(1.0)  # iterations end at 3, 6, 9
    ledger.pause(Phase.RECONFIGURING, 2.0)
    ledger.set_rate(5.0, 4.0)
    ledger.advance(17.0)  # the new stretch starts at 12
    assert ledger.lose_inflight() == pytest.approx(1.0)
    assert [s.phase for s in ledger.segments] == [Phase.TRAINING, Phase.LOST, Phase.RECONFIGURING,
                                                  Phase.DEGRADED, Phase.LOST]


def test_distribute_batch_balances_heterogeneous_pipelines() -> None:
    time_of = lambda n, m: (m + n - 1) * 0.6 / n  # noqa: E731
    shares, t = distribute_batch([2, 1], 8, time_of)
    assert shares == [5, 3] and t == pytest.approx(1.8)
    shares, t = distribute_batch([3, 3, 3], 9, time_of)
    assert shares == [3, 3, 3]
    shares, t = distribute_batch([4, 2, 4, 1], 40, time_of)
    assert sum(shares) == 40
    best = min(max(time_of(n, m) for n, m in zip([4, 2, 4, 1], (a, b, 40 - a - b - c, c)) if m > 0)
               for a in range(41) for b in range(41 - a) for c in range(41 - a - b))
    assert t == pytest.approx(best)


def test_group_spread_is_even_and_complete() -> None:
    groups = _spread([3, 0, 9, 1], (8, 8, 8))
    assert sum(len(g) for g in groups) == 13
    per_stage = [[sum(1 for _, s in g if s == st) for g in groups] for st in range(4)]
    assert all(max(c) - min(c) <= 1 for c in per_stage)
    assert all(len({p for p, s in g if s == 2}) == sum(1 for _, s in g if s == 2) for g in groups)


def test_large_jobs_plan_per_group(tiny_workload: Workload) -> None:
    timer = PipelineTimer(tiny_workload, JobShape(2, 20, 4, group=8))
    assert timer.shape.group_sizes == (7, 7, 6)
    one = timer.recycle_iteration_s(frozenset({(13, 0)}))
    none = timer.recycle_iteration_s(frozenset())
    assert one > none


def test_models_are_documented_and_partitioned() -> None:
    assert set(MODELS) == {"gpt3-medium", "gpt3-2.7b", "gpt3-6.7b"}
    assert get_model("gpt3-6.7b").params == pytest.approx(6.65e9, rel=0.03)
    assert get_model("gpt3-2.7b").params == pytest.approx(2.65e9, rel=0.03)
    split = stage_layers(32, 6, 1.4)
    assert sum(split) == 32 and max(split) == 6
    with pytest.raises(ValueError, match="gpt3-medium"):
        get_model("gpt4")
    costs = workload_from_model(get_model("gpt3-2.7b"), 4).costs_at(8, 4)
    assert all(b > w for b, w in zip(costs.B, costs.W))  # W is the cheaper half of the backward
    assert costs.stages == 8


def test_parse_systems() -> None:
    assert parse_systems("recycle, oobleck,recycle") == [SystemKind.RECYCLE, SystemKind.OOBLECK]
    assert len(parse_systems("all")) == len(SystemKind)
    with pytest.raises(ValueError, match="'foo' is not a system"):
        parse_systems("recycle,foo")


def test_report_and_json(tiny_workload: Workload, tiny_assumptions) -> None:  # type: ignore[no-untyped-def]
    trace = parse_trace([f"0,add,n{i}" for i in range(1, 5)] + ["1000000,remove,n1"])
    result = simulate(trace, tiny_workload, SHAPE, [SystemKind.RECYCLE, SystemKind.CHECKPOINT],
                      hours=1.0, assumptions=tiny_assumptions)
    table = format_table(result)
    assert "recycle" in table and "checkpoint" in table and "x" in table.splitlines()[-1]
    doc = json.loads(json.dumps(to_json(result)))
    assert doc["format"] == "ds-recycle-simulation/1"
    rc = doc["systems"]["recycle"]
    assert sum(rc["breakdown"].values()) == pytest.approx(1.0)
    assert doc["systems"]["checkpoint"]["recycle_over_this"] == pytest.approx(result.ratio(SystemKind.CHECKPOINT))
    assert all(row["source"] for row in doc["assumptions"].values())


def test_cli_end_to_end(traces_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["simulate", "--trace", str(traces_dir / "6h.csv"), "--model", "gpt3-medium",
               "--stages", "2", "--pipelines", "3", "--microbatches", "4", "--hours", "40",
               "--systems", "recycle,checkpoint,drop", "--json", str(out_json), "--png", str(out_png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "samples/s" in text and "assumptions:" in text and "Young" in text
    assert json.loads(out_json.read_text())["job"]["stages"] == 2
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, words", [
    (["--trace", "/nonexistent.csv", "--pipelines", "2"], "does not exist"),
    (["--mtbf", "1", "--pipelines", "2"], "--hours"),
    (["--mtbf", "-1", "--pipelines", "2", "--hours", "1"], "--mtbf"),
    (["--mtbf", "1", "--hours", "1"], "--pipelines"),
    (["--mtbf", "1", "--hours", "1", "--nodes", "4", "--stages", "6"], "fewer than"),
    (["--mtbf", "1", "--hours", "1", "--pipelines", "2", "--model", "gpt9"], "gpt3-medium"),
    (["--mtbf", "1", "--hours", "1", "--pipelines", "2", "--systems", "x"], "not a system"),
    (["--mtbf", "1", "--hours", "1", "--pipelines", "2", "--stages", "40"], "stages"),
    (["--mtbf", "1", "--hours", "1", "--pipelines", "2", "--gpus-per-node", "0"], "--gpus-per-node"),
])
def test_cli_rejects_bad_arguments(argv: list[str], words: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *argv]) == 2
    assert words in capsys.readouterr().err


def test_binned_rate_integrates_the_useful_samples(tiny_workload: Workload, tiny_assumptions) -> None:  # type: ignore[no-untyped-def]
    from ds_recycle.cluster.draw import binned_rate

    trace = parse_trace([f"0,add,n{i}" for i in range(1, 5)] + ["1000000,remove,n1"])
    result = simulate(trace, tiny_workload, SHAPE, [SystemKind.CHECKPOINT], hours=1.0,
                      assumptions=tiny_assumptions)
    xs, ys = binned_rate(result, SystemKind.CHECKPOINT, bins=36)
    assert len(xs) == 36 and xs[0] == pytest.approx(50 / 3600)
    assert sum(ys) * 100 == pytest.approx(result.systems[SystemKind.CHECKPOINT].samples)


def test_a_reconfiguration_does_not_cut_a_restart_short() -> None:
    ledger = Ledger(full_rate=10.0, checkpoint=None)
    ledger.set_rate(10.0, 1.0)
    ledger.advance(10.0)
    ledger.pause(Phase.RESTARTING, 100.0)
    ledger.advance(50.0)
    ledger.pause(Phase.RECONFIGURING, 5.0)
    ledger.advance(200.0)
    assert [(s.phase, s.start_s, s.end_s) for s in ledger.segments] == [
        (Phase.TRAINING, 0.0, 10.0), (Phase.RESTARTING, 10.0, 110.0), (Phase.TRAINING, 110.0, 200.0)]


def test_bamboo_refuses_a_model_whose_double_state_does_not_fit(tmp_path: Path) -> None:
    from ds_recycle.cluster.workload import workload_from_costs_file

    path = tmp_path / "c.json"
    path.write_text(json.dumps({"F": [0.1, 0.1], "B": [0.1, 0.1], "W": [0.1, 0.1], "O": [0, 0], "comm": 0}))
    big = workload_from_costs_file(path, micro_batch=1, state_gb=1000.0, reconfigure_s=1.0, restart_s=1.0)
    trace = parse_trace([f"0,add,n{i}" for i in range(1, 5)])
    with pytest.raises(ValueError, match="Bamboo needs 1000 GB"):
        simulate(trace, big, SHAPE, [SystemKind.BAMBOO], hours=1.0)
    assert simulate(trace, big, SHAPE, [SystemKind.RECYCLE], hours=1.0).systems  # others are fine


def test_recycle_times_are_the_planners(tiny_workload: Workload) -> None:
    """One planner, not two: the simulator's ReCycle iteration time is PlanCache's, for any set."""
    from ds_recycle.plan import PlanCache

    shape = JobShape(2, 3, 4)
    timer = PipelineTimer(tiny_workload, shape)
    cache = PlanCache(2, 3, 4, tiny_workload.costs_at(2, 3))
    for failed in [frozenset(), frozenset({(1, 0)}), frozenset({(0, 0), (2, 1)}),
                   frozenset({(0, 1), (1, 1)})]:
        assert timer.recycle_iteration_s(failed) == cache.time_per_iteration(failed)
    assert timer.stats.recycle_plans == 4
    timer.recycle_iteration_s(frozenset({(2, 0)}))  # a relabelling of a set seen before: no new plan
    assert timer.stats.recycle_plans == 4
