"""Pure parts of run-time survival: the fault config, --kill, snapshots (no processes)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ds_recycle.config import ConfigError, load_config
from ds_recycle.resilience.faults import Phase
from ds_recycle.resilience.runner import faults_of
from ds_recycle.resilience.snapshot import SnapshotRing
from ds_recycle.train.loop import _load, parse_args

REPO = Path(__file__).resolve().parents[2]


def _raw(**recycle: object) -> dict:
    raw = json.loads((REPO / "configs" / "gpt_cpu_2x2.json").read_text())
    raw["recycle"].update(recycle)
    return raw


def test_faults_from_config_and_command_line_merge(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps(_raw(faults=[{"worker": [1, 0], "iteration": 3, "phase": "send"}])))
    cfg = _load(parse_args(["--deepspeed_config", str(path), "--kill", "0:1@5:optimizer-step"]))
    specs = faults_of(cfg)
    assert [(f.pipeline, f.stage, f.iteration, f.phase) for f in specs] == [
        (1, 0, 3, Phase.SEND), (0, 1, 5, Phase.OPTIMIZER_STEP)]


@pytest.mark.parametrize("fault,field", [
    ({"worker": [2, 0], "iteration": 1}, "recycle.faults[0].worker"),
    ({"worker": [0, 0], "iteration": 1, "phase": "lunch"}, "recycle.faults[0].phase"),
    ({"worker": [0, 0], "iteration": -1}, "iteration"),
])
def test_bad_faults_are_refused_with_the_field(fault: dict, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(_raw(faults=[fault]))
    assert field in str(e.value)


def test_bad_kill_argument_names_the_format(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--deepspeed_config", "x.json", "--kill", "1:0@3:lunch"])
    err = capsys.readouterr().err
    assert "--kill" in err and "unknown phase 'lunch'" in err


def test_timeouts_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="failure_timeout_s"):
        load_config(_raw(failure_timeout_s=0))


class _Engine:
    """The attributes a snapshot reads and writes, on a real module and optimizer."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.module = torch.nn.Linear(4, 3)
        self.optimizer = torch.optim.Adam(self.module.parameters(), lr=0.1)
        self.lr_scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, 1, 0.5)
        self.iteration = self.global_steps = self.global_samples = 0

    def step(self) -> None:
        self.module(torch.ones(2, 4)).sum().backward()
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad()
        self.iteration += 1
        self.global_steps += 1
        self.global_samples += 8


def test_snapshot_restore_redoes_bit_identically() -> None:
    eng, ring = _Engine(), SnapshotRing(depth=2)
    for _ in range(3):
        ring.take(eng)
        eng.step()
    reference = [p.detach().clone() for p in eng.module.parameters()]
    ring.restore(1, eng)  # two iterations back, as a stage that had stepped ahead would
    assert eng.iteration == 1 and eng.global_steps == 1 and ring.latest == 1
    for _ in range(2):
        ring.take(eng)
        eng.step()
    assert all(torch.equal(a, b) for a, b in zip(reference, eng.module.parameters()))


def test_snapshot_ring_refuses_an_iteration_it_no_longer_holds() -> None:
    eng, ring = _Engine(), SnapshotRing(depth=2)
    for _ in range(3):
        ring.take(eng)
        eng.step()
    with pytest.raises(RuntimeError, match="cannot redo iteration 0"):
        ring.restore(0, eng)
