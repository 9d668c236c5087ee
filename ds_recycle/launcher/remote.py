"""Commands that start the launchers of nodes 1..N-1 over ssh (multi-host jobs).

Node 0's launcher runs each command below as a child process. The remote launcher gets the whole layout
(``--world_info``), its ``--node_rank`` and the store's address, so it needs no hostfile; it connects to the
job's store (node 0's, or a ``ds-recycle store`` service) as a client, starts its own workers, writes their
exits to the store, and obeys ``ds_recycle/stop``. Tested with real ssh between hosts made as network
namespaces (``tests/hosts/``) and, on one machine, with a stand-in ``ssh`` (``tests/launcher/test_multinode.py``).
Assumptions, as for `deepspeed`'s ssh-based runners: passwordless ssh to every host, the same working
directory and the same Python environment (same interpreter path) on every host. Environment variables whose
names start with one of :data:`EXPORT_PREFIXES`, plus ``KEY=VALUE`` lines of ``.deepspeed_env`` files in the
home and working directories, are exported to the remote command.
"""
from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from pathlib import Path

from ds_recycle.launcher.job import JobSpec

__all__ = ["EXPORT_PREFIXES", "default_env_files", "exported_env", "launcher_argv", "ssh_command"]

#: launcher environment variables (by name prefix) that the remote launchers receive
EXPORT_PREFIXES = ("PYTHON", "DS_", "OMP_", "MKL_", "NCCL_", "GLOO_", "TORCH_", "WANDB_", "HF_")
#: set per node by the remote launcher itself, never copied from node 0
_NOT_EXPORTED = ("CUDA_VISIBLE_DEVICES", "DS_RECYCLE_")
#: job-wide settings under those prefixes, which every node must share (engine/p2p.py's message order check)
_JOB_WIDE = ("DS_RECYCLE_CHECK_ORDER",)


def exported_env(env: Mapping[str, str], env_files: tuple[Path, ...] = ()) -> dict[str, str]:
    """The variables of ``env`` that travel to remote launchers, plus those of ``env_files`` (later files win)."""
    chosen = {k: v for k, v in env.items()
              if k in _JOB_WIDE or (k.startswith(EXPORT_PREFIXES) and not k.startswith(_NOT_EXPORTED))}
    for file in env_files:
        if file.is_file():
            for line in file.read_text(encoding="utf-8").splitlines():
                key, sep, value = line.strip().partition("=")
                if sep and key and not key.startswith("#"):
                    chosen[key] = value
    return chosen


def launcher_argv(job: JobSpec, node_rank: int) -> list[str]:
    """``python -u -m ds_recycle launch ...`` for ``node_rank``, reproducing node 0's options."""
    policy, program = job.policy, job.program
    argv = [program.python, "-u", "-m", "ds_recycle", "launch", "--node_rank", str(node_rank),
            "--world_info", job.layout.encode(), "--master_addr", job.master_addr,
            "--master_port", str(job.master_port), "--threads_per_worker", str(job.threads_per_worker or 0),
            "--error_grace", str(policy.error_grace_s), "--kill_grace", str(policy.kill_grace_s),
            "--max_restarts", str(policy.max_restarts), "--node_timeout", str(job.node_timeout_s)]
    if job.log_ranks is not None:
        argv += ["--log_ranks", ",".join(str(r) for r in sorted(job.log_ranks))]
    if policy.restart_after_s is not None:
        argv += ["--restart_failed_after", str(policy.restart_after_s)]
    if job.store is not None:
        argv += ["--store", job.store]
    flags = {"--store_service": job.store_service, "--strict": policy.strict, "--module": program.module, "--no_python": program.no_python,
             "--no_local_rank": not program.pass_local_rank}
    argv += [flag for flag, on in flags.items() if on]
    return argv + [program.target, *program.args]


def ssh_command(job: JobSpec, node_rank: int, cwd: str, env: Mapping[str, str], ssh_port: int | None = None) -> list[str]:
    """The local argv that starts ``node_rank``'s launcher on its host: ``ssh HOST 'cd CWD && env ... python ...'``."""
    host = job.layout.nodes[node_rank].host
    exports = [f"{k}={v}" for k, v in sorted(env.items())]
    remote = " ".join(shlex.quote(part) for part in ["env", *exports, *launcher_argv(job, node_rank)])
    port = ["-p", str(ssh_port)] if ssh_port is not None else []
    return ["ssh", "-o", "BatchMode=yes", *port, host, f"cd {shlex.quote(cwd)} && {remote}"]


def default_env_files() -> tuple[Path, ...]:
    """``~/.deepspeed_env`` then ``./.deepspeed_env`` (the name can be changed with ``DS_ENV_FILE``)."""
    name = os.environ.get("DS_ENV_FILE", ".deepspeed_env")
    return (Path.home() / name, Path.cwd() / name)
