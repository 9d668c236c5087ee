"""A job as data: what runs where, and each rank's command line and environment (pure; no processes)."""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from ds_recycle.launcher.hosts import Layout
from ds_recycle.launcher.policy import ExitPolicy
from ds_recycle.launcher.worker import LOST_EXIT_CODE, WorkerSpec

__all__ = ["NCCL_ENV", "JobSpec", "Program", "worker_env", "worker_specs"]


_BOOTSTRAP = "ds_recycle.launcher.bootstrap"

NCCL_ENV: Mapping[str, str] = {
    # torch's watchdog must never end a survivor: its default (3, SkipCleanUp) kills the process on an NCCL error
    # or a timeout; ds_recycle aborts the communicators of a failed epoch itself (ProcessGroupNCCL.hpp,
    # ErrorHandlingMode; torch's `_abort_process_group` asks for 0)
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    # the heartbeat monitor kills the process when the watchdog makes no progress, which a long recovery is
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    # no debug dump (and the sleep of four dump timeouts before the watchdog reacts) on a timeout
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    # a CUDA error seen by the watchdog is not rethrown as a process abort; the worker leaves and rejoins
    # (nvidia-resiliency-ext's in-process restart recommends it)
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
    # NVLink SHARP buffers are not released by an abort (nvidia-resiliency-ext's known issues)
    "NCCL_NVLS_ENABLE": "0",
    # the p2p, norm and stage communicators of an epoch share the GPU: NCCL 2.26+ then runs their operations in the
    # order the host launched them, which is one order on every rank (the engine issues them from one thread in the
    # plan's order, ds_recycle/engine/issue.py); older NCCL ignores it (NCCL's env.rst, usage/communicators.rst)
    "NCCL_LAUNCH_ORDER_IMPLICIT": "1",
}
"""The NCCL settings every worker of ``ds-recycle launch`` gets unless the launcher's own environment sets them
(the user's value wins; see docs/launcher.md). A CPU job never reads them."""


@dataclass(frozen=True)
class Program:
    """The user's program: ``python -u script args``, ``python -u -m module args`` or ``executable args``.

    Python targets run through :mod:`ds_recycle.launcher.bootstrap`, which sets up the process group a
    surviving job needs (also in a restarted rank) before the script's own ``deepspeed.init_distributed()``.
    """

    target: str
    args: tuple[str, ...] = ()
    module: bool = False
    no_python: bool = False
    pass_local_rank: bool = True
    """Append ``--local_rank=N`` before the user's arguments, as the `deepspeed` launcher does."""
    python: str = sys.executable

    def __post_init__(self) -> None:
        if self.module and self.no_python:
            raise ValueError("--module and --no_python exclude each other: --module runs `python -m TARGET`")

    def argv(self, local_rank: int) -> tuple[str, ...]:
        if self.no_python:
            head: tuple[str, ...] = (self.target,)
        else:
            head = (self.python, "-u", "-m", _BOOTSTRAP, *(("-m",) if self.module else ()), self.target)
        return head + ((f"--local_rank={local_rank}",) if self.pass_local_rank else ()) + self.args


@dataclass(frozen=True)
class JobSpec:
    """Everything one node's launcher needs to start its workers."""

    layout: Layout
    node_rank: int
    master_addr: str
    master_port: int
    """The store's actual port (never 0 here: port 0 is resolved when the store starts)."""
    program: Program
    policy: ExitPolicy = ExitPolicy()
    threads_per_worker: int | None = 1
    """OMP/MKL threads per worker; None leaves the environment alone."""
    log_ranks: frozenset[int] | None = None
    """Ranks whose stdout is shown (stderr is always shown); None: all."""
    base_env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ), hash=False)
    cuda_available: bool = False
    node_timeout_s: float = 10.0
    """A node whose launcher's heartbeat has not moved for this long is lost (see :mod:`.hostwatch`)."""
    store_service: bool = False
    """The store is a ``ds-recycle store`` service at ``master_addr:master_port``: node 0 connects to it too."""
    store: str | None = None
    """``etcd://host:port,...[/namespace]``: the job's store is that etcd cluster (``--store``); None: a TCPStore."""

    def __post_init__(self) -> None:
        if not self.node_timeout_s > 0:
            raise ValueError(f"--node_timeout {self.node_timeout_s}: give a positive number of seconds (default 10; "
                             f"a launcher cut off from the store fences its workers after half of it)")

    @property
    def local_ranks(self) -> range:
        first = self.layout.offset(self.node_rank)
        return range(first, first + len(self.layout.nodes[self.node_rank].slots))


def worker_env(job: JobSpec, rank: int) -> dict[str, str]:
    """The environment of global ``rank``: the launcher's own plus the env:// contract and ds_recycle's keys."""
    node = job.layout.nodes[job.node_rank]
    local_rank = rank - job.layout.offset(job.node_rank)
    env = {**NCCL_ENV, **job.base_env}
    env.update({
        "MASTER_ADDR": job.master_addr, "MASTER_PORT": str(job.master_port),
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(job.layout.world_size),
        "LOCAL_WORLD_SIZE": str(len(node.slots)), "LOCAL_SIZE": str(len(node.slots)),
        "GROUP_RANK": str(job.node_rank), "CROSS_RANK": str(job.node_rank), "CROSS_SIZE": str(len(job.layout.nodes)),
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
        "DS_RECYCLE_LAUNCHER": "1", "DS_RECYCLE_STORE": f"{job.master_addr}:{job.master_port}",
        "DS_RECYCLE_RESTART_COUNT": "0", "DS_RECYCLE_LOST_EXIT_CODE": str(LOST_EXIT_CODE),
        "CUDA_VISIBLE_DEVICES": _visible_devices(node.slots, job.base_env.get("CUDA_VISIBLE_DEVICES")),
        "PYTHONUNBUFFERED": env.get("PYTHONUNBUFFERED", "1"),
    })
    if job.store is not None:  # WORLD is initialised over the etcd store itself, not env://'s TCPStore
        env["DS_RECYCLE_STORE"] = job.store
        env["TORCHELASTIC_USE_AGENT_STORE"] = "False"
    if job.threads_per_worker is not None and "OMP_NUM_THREADS" not in job.base_env:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(job.threads_per_worker)
    if not job.cuda_available and "DS_ACCELERATOR" not in job.base_env:
        env["DS_ACCELERATOR"] = "cpu"
    return env


def _visible_devices(slots: tuple[int, ...], inherited: str | None) -> str:
    """The node's slots as device ids; slot i means the i-th device the launcher itself sees, if it sees a subset."""
    devices = [d.strip() for d in inherited.split(",")] if inherited else []
    if not devices or any(not d.isdigit() for d in devices):  # unset, or GPU UUIDs: slots are device numbers
        return ",".join(str(slot) for slot in slots)
    if max(slots) >= len(devices):
        raise ValueError(f"slots {list(slots)} need {max(slots) + 1} devices, but CUDA_VISIBLE_DEVICES={inherited} "
                         f"shows {len(devices)}; ask for fewer or unset CUDA_VISIBLE_DEVICES")
    return ",".join(devices[slot] for slot in slots)


def worker_specs(job: JobSpec) -> list[WorkerSpec]:
    """One spec per rank of this node, in rank order."""
    first = job.layout.offset(job.node_rank)
    return [WorkerSpec(name=f"rank {rank}", rank=rank, argv=job.program.argv(rank - first), env=worker_env(job, rank),
                       show_stdout=job.log_ranks is None or rank in job.log_ranks, prefix=f"[rank {rank}] ")
            for rank in job.local_ranks]
