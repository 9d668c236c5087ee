"""No tensor of the engine or of its failure handling is made on an implicit device (ds_recycle/engine/devices.py).

A constructor without ``device=`` makes a CPU tensor, which a GPU job then feeds to CUDA kernels or to NCCL: the
scan below fails on the first one that comes back, naming the file and line.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ds_recycle.engine.devices import HOST, StagedWork, device_of, host_buffer, host_copy, staged
from ds_recycle.resilience.accelerator import (
    place_worker,
    shared_cuda_accelerator,
    worker_device_index,
    workers_per_gpu,
)
from ds_recycle.resilience.comm import EpochGroup

PACKAGE = Path(__file__).resolve().parents[2] / "ds_recycle"
SCANNED = ("engine", "resilience")
CONSTRUCTORS = {"zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "linspace", "eye", "rand",
                "randn", "randint", "randperm"}


def implicit_devices(source: str, name: str) -> list[str]:
    """``name:line: call`` for each ``torch.<constructor>(...)`` in ``source`` that names no device."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CONSTRUCTORS
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)):
            found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_every_tensor_of_the_engine_and_its_failure_handling_names_its_device() -> None:
    files = sorted(p for folder in SCANNED for p in (PACKAGE / folder).rglob("*.py"))
    assert len(files) > 40
    found = [hit for path in files for hit in implicit_devices(path.read_text(), str(path.relative_to(PACKAGE)))]
    assert not found, ("tensors made on an implicit device (give device=: the stage's for data, the transport's "
                       "for control messages, see ds_recycle/engine/devices.py):\n" + "\n".join(found))


def test_the_scan_finds_an_implicit_device_and_accepts_a_named_one() -> None:
    source = "import torch\na = torch.zeros(3)\nb = torch.zeros(3, device=d)\nc = x.new_zeros(3)\n"
    assert implicit_devices(source, "m.py") == ["m.py:2: torch.zeros(3)"]


def test_device_of_a_module_is_its_parameters_then_its_buffers_then_the_host() -> None:
    with_buffer = nn.Module()
    with_buffer.register_buffer("b", torch.zeros(1, device="meta"))
    assert device_of(nn.Linear(2, 2, device="meta")) == torch.device("meta")
    assert device_of(with_buffer) == torch.device("meta")
    assert device_of(nn.ReLU()) == HOST


class _Work:
    def __init__(self) -> None:
        self.waited = 0

    def wait(self) -> bool:
        self.waited += 1
        return True


def test_host_tensors_go_to_gloo_as_they_are() -> None:
    t = torch.arange(3.0, device=HOST)
    assert host_copy(t) is t and host_buffer(t) is t
    work = _Work()
    assert staged(work, outputs=[(t, t)], inputs=[(t, t)]) is work
    group = EpochGroup(dist.HashStore(), "one", [0], 0, 5.0)  # gloo, one member
    raw = group.all_reduce_sum(t)
    assert not isinstance(raw, StagedWork) and raw.wait() and torch.equal(t, torch.arange(3.0, device=HOST))


def test_a_staged_operation_copies_its_outputs_back_once_waited_for() -> None:
    """What gloo does on a GPU's data, with a second host tensor standing for the GPU's (no GPU here)."""
    target, host = torch.zeros(3, device=HOST), torch.zeros(3, device=HOST)
    sent = torch.ones(2, device=HOST)
    work = _Work()
    op = staged(work, outputs=[(target, host)], inputs=[(torch.zeros(2, device=HOST), sent)])
    assert isinstance(op, StagedWork)
    host.fill_(7.0)  # gloo writes the host tensor while the operation runs
    assert torch.equal(target, torch.zeros(3, device=HOST))  # not copied before the wait
    assert op.wait() and work.waited == 1 and torch.equal(target, host)
    target.zero_()
    assert op.wait() and torch.equal(target, torch.zeros(3, device=HOST))  # copied once, not again


# ------------------------------------------------------------------------------------ workers sharing a GPU
def test_workers_beyond_the_gpus_share_them_round_robin_and_deepspeed_places_them_there() -> None:
    """DeepSpeed places a worker on ``device_name(LOCAL_RANK)``: with fewer GPUs than workers, the shared
    accelerator reads local rank ``i`` as GPU ``i mod GPUs`` (built here without a GPU: only names are asked)."""
    assert [worker_device_index(r, 2) for r in range(5)] == [0, 1, 0, 1, 0]
    accelerator = shared_cuda_accelerator(1)
    assert [accelerator.device_name(r) for r in range(4)] == ["cuda:0"] * 4
    assert accelerator.device(3) == torch.device("cuda", 0) and accelerator.device_name() == "cuda"
    with pytest.raises(ValueError, match="no CUDA device"):
        worker_device_index(0, 0)


def test_a_cpu_worker_is_placed_nowhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert place_worker(3) is None


def test_an_accelerators_tensor_is_staged_in_pinned_memory_or_pageable_where_pinning_is_refused(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A meta tensor stands for a GPU's: its staging buffer is a host tensor of its shape and dtype. This CPU build of
    torch has no pinned allocator, so the first buffer falls back to pageable memory, says so once, and stays so."""
    import ds_recycle.engine.devices as devices

    monkeypatch.setattr(devices, "_pinned", True)
    gpu_like = torch.empty(2, 3, dtype=torch.bfloat16, device="meta")
    first, second = host_buffer(gpu_like), host_buffer(gpu_like)
    for buf in (first, second):
        assert buf.device == HOST and buf.shape == (2, 3) and buf.dtype == torch.bfloat16
    pinnable = torch.cuda.is_available()
    assert first.is_pinned() == pinnable and devices._pinned == pinnable
    assert ("pinned host memory refused" in caplog.text) != pinnable


def test_workers_per_gpu_is_the_nodes_workers_over_its_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert workers_per_gpu() == 4
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert workers_per_gpu() == 1
