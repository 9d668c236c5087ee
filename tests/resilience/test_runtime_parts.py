"""Pure parts of run-time survival: the fault config, --kill, stage state, the boundary log (no processes)."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from ds_recycle.config import ConfigError, load_config
from ds_recycle.engine.boundary_log import BoundaryLog, Role
from ds_recycle.engine.p2p import Channel
from ds_recycle.engine.stage_state import StageState
from ds_recycle.resilience.faults import Phase
from ds_recycle.resilience.injection import faults_of
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
    """The attributes a stage state reads and writes, on a real module and optimizer."""

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


def test_stage_state_moves_a_stage_whole_and_training_continues_bit_identically() -> None:
    eng, other = _Engine(), _Engine()
    for _ in range(3):
        eng.step()
    buf = io.BytesIO()
    torch.save(StageState.of(eng), buf)  # what a roll-forward or a join sends
    torch.load(io.BytesIO(buf.getvalue()), weights_only=False).restore(other)
    assert other.iteration == other.global_steps == 3 and other.global_samples == 24
    for _ in range(2):
        eng.step()
        other.step()
    assert all(torch.equal(a, b) for a, b in zip(eng.module.parameters(), other.module.parameters()))


def test_boundary_log_keeps_two_iterations_and_forgets_thrown_away_work() -> None:
    log = BoundaryLog()
    for k in range(4):
        log.begin(k)
        log.record(k, Channel.ACTIVATION, Role.SENT, (0, 1), torch.ones(4))
        log.record(k, Channel.GRAD, Role.RECEIVED, (0, 1), (torch.ones(2), torch.zeros(2)))
    assert {k for k in range(4) if list(log.held(k))} == {2, 3}  # begin(3) dropped iterations before 2
    assert log.nbytes() == 2 * (16 + 16) and log.peak_bytes == 2 * (16 + 16)
    assert torch.equal(log.get(3, Channel.ACTIVATION, Role.SENT, (0, 1)), torch.ones(4))
    with pytest.raises(RuntimeError, match="received activation of micro-batch"):
        log.get(3, Channel.ACTIVATION, Role.RECEIVED, (0, 1))
    log.discard_from(3)
    assert len(log) == 2 and not list(log.held(3)) and log.nbytes() == 32


def test_boundary_log_releases_received_entries_at_the_step_and_sent_ones_when_the_peer_moves_on() -> None:
    log = BoundaryLog()
    log.begin(5)
    log.record(5, Channel.ACTIVATION, Role.SENT, (0, 0), torch.ones(4), peer=3)  # to the next stage
    log.record(5, Channel.ACTIVATION, Role.SENT, (1, 0), torch.ones(4), peer=7)  # a re-routed micro-batch
    log.record(5, Channel.GRAD, Role.RECEIVED, (0, 0), torch.ones(4), peer=3)
    log.record(5, Channel.ACTIVATION, Role.RECEIVED, (0, 0), torch.ones(4), peer=1)
    log.stepped(5)  # its stage is committed for 5: nothing it received then is asked for
    assert sorted(role.value for _, role, _ in log.held(5)) == ["sent", "sent"]
    log.begin(6)
    log.record(6, Channel.ACTIVATION, Role.RECEIVED, (0, 0), torch.ones(4), peer=1)  # rank 1 gave nothing back
    assert len(list(log.held(5))) == 2
    log.record(6, Channel.GRAD, Role.RECEIVED, (0, 0), torch.ones(4), peer=3)  # rank 3 began 6: it stepped 5
    assert [mb for _, _, mb in log.held(5)] == [(1, 0)]  # what went to rank 7 stays until rank 7 moves on
    assert log.nbytes() == 3 * 16 and log.peak_bytes == 4 * 16
    log.heard_from(6, 7)
    assert not list(log.held(5))


def test_a_boundary_log_on_the_host_copies_accelerator_tensors_and_gives_them_back_on_the_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``recycle.boundary_log: "pinned_host"``: a logged tensor is kept as its host copy (``devices.offload``, which
    leaves a host tensor as it is), and a repair gets it back on its device."""
    import ds_recycle.engine.boundary_log as boundary_log

    offloaded: list[torch.Tensor] = []

    def offload(tensor: torch.Tensor) -> torch.Tensor:  # a meta tensor stands for a GPU's, which CPU torch lacks
        offloaded.append(tensor)
        return torch.full(tensor.shape, 2.0) if tensor.device.type == "meta" else tensor
    monkeypatch.setattr(boundary_log, "offload", offload)
    log = BoundaryLog(on_host=True)
    gpu_like = torch.empty(3, device="meta")
    log.record(1, Channel.ACTIVATION, Role.RECEIVED, (0, 0), gpu_like, peer=1)
    log.record(1, Channel.GRAD, Role.RECEIVED, (0, 0), (gpu_like, gpu_like), peer=2)
    assert len(offloaded) == 3
    kept = log.get(1, Channel.ACTIVATION, Role.RECEIVED, (0, 0))
    assert isinstance(kept, torch.Tensor) and kept.device.type == "cpu" and torch.equal(kept, torch.full((3,), 2.0))
    back = log.get(1, Channel.GRAD, Role.RECEIVED, (0, 0), device=torch.device("meta"))
    assert isinstance(back, tuple) and [t.device.type for t in back] == ["meta", "meta"]


def test_offload_leaves_a_host_tensor_as_it_is() -> None:
    from ds_recycle.engine.devices import offload

    host = torch.ones(2)
    assert offload(host) is host
