"""``ds-recycle launch``: start a job's workers so that they survive each other's failures.

Unlike the `deepspeed` launcher and ``torchrun``, which kill every worker when one dies, this launcher hosts
the job's store itself (or connects to a ``ds-recycle store`` service), never signals a survivor because
another worker was lost, records every exit in the store, restarts lost ranks (after a delay, on command, or
for a fallback to the checkpoint) and exits non-zero only if the job as a whole failed or was stopped::

    ds-recycle launch --num_accelerators 4 train.py --deepspeed_config cfg.json
    python -m ds_recycle launch --num_gpus 4 --master_port 0 --log_ranks 0 train.py
    ds-recycle restart --master_addr 127.0.0.1 --master_port 29500 2      # rank 2 was lost: start it again now

Modules: :mod:`.cli` (options and start-up), :mod:`.hosts` (hostfile, ``--include``/``--exclude``),
:mod:`.job` (each rank's command line and environment), :mod:`.worker` (one process), :mod:`.policy` (exit
rules), :mod:`.supervisor` (the loop), :mod:`.bootstrap` (what each Python worker runs around the script),
:mod:`.remote` (ssh commands), :mod:`.nodes` (node 0's wait for ``--no_ssh`` nodes), :mod:`.hostwatch`
(hosts as units of failure), :mod:`.fencing` (SIGKILL of hung workers), :mod:`.restart_requests` and
:mod:`.restart_cmd` (restarts on command, ``ds-recycle restart``), :mod:`.store_cmd` (``ds-recycle store``),
:mod:`.netif` (gloo's interface). The store's keys: :mod:`ds_recycle.runtime.job_store`.

The manual (worker environment, store keys, exit rules, restarts, several hosts, what is tested) is
``docs/launcher.md``.
"""
from __future__ import annotations

from ds_recycle.launcher.hosts import HostfileError, Layout, NodeSlots, resolve_layout
from ds_recycle.launcher.job import JobSpec, Program, worker_env, worker_specs
from ds_recycle.launcher.policy import Action, ExitPolicy, decide, job_status
from ds_recycle.launcher.worker import LOST_EXIT_CODE, ExitKind, Worker, WorkerExit, WorkerSpec

__all__ = [
    "Action", "ExitKind", "ExitPolicy", "HostfileError", "JobSpec", "LOST_EXIT_CODE", "Layout", "NodeSlots",
    "Program", "Worker", "WorkerExit", "WorkerSpec", "decide", "job_status", "resolve_layout", "worker_env",
    "worker_specs",
]
