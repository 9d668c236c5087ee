"""A ds_recycle job across :class:`~tests.nethosts.NetHosts`: launchers per host, their logs, bounded waits.

:class:`HostJob` starts ``ds-recycle launch launch/train.py`` on the hosts of a :class:`NetHosts`, either once on
host 0 with ``--hostfile`` (node 0 starts the others over real ssh) or once per host with ``--no_ssh
--node_rank K``, optionally with a ``ds-recycle store`` service on a host that runs no worker. Each process's
output goes to a file in the job's folder; :meth:`HostJob.wait_iteration` follows the metrics file. The tests
in this folder and ``benchmarks/hosts.py`` use it.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from ds_recycle.events import Event, events_of
from tests.harness import REPO
from tests.nethosts import NetHosts

E = TypeVar("E", bound=Event)

__all__ = ["HostJob", "PORT"]

#: every host has its own network stack, so a fixed port never collides with another job on this machine
PORT = 29500


class HostJob:
    """One training job on ``worker_hosts`` of ``hosts`` (``slots`` workers each); see the module docstring."""

    def __init__(self, hosts: NetHosts, folder: Path, config: Path, steps: int, slots: int,
                 worker_hosts: Sequence[int], train_args: Sequence[str] = (), launcher_args: Sequence[str] = (),
                 node_timeout_s: float = 6.0, store_host: int | None = None) -> None:
        self.hosts, self.folder, self.steps = hosts, folder, steps
        self.worker_hosts = list(worker_hosts)
        self.store_host = store_host
        self.metrics_path = folder / "metrics.jsonl"
        self.final_path = folder / "final.pt"
        self.hostfile = hosts.hostfile(slots, self.worker_hosts, name=f"hostfile-{folder.name}")
        master = [] if store_host is None else ["--store_service", "--master_addr", hosts.addrs[store_host]]
        self.launcher = [sys.executable, "-m", "ds_recycle", "launch", "--hostfile", str(self.hostfile),
                         "--master_port", str(PORT), "--node_timeout", str(node_timeout_s), *master, *launcher_args]
        self.train = [str(REPO / "launch" / "train.py"), "--deepspeed_config", str(config), "--steps", str(steps),
                      "--metrics", str(self.metrics_path), "--save-final", str(self.final_path), *train_args]
        self.env = hosts.env({"PYTHONPATH": str(REPO), "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"})
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self._starts = 0

    # ---- starting things ---------------------------------------------------------------------------------------
    def _start(self, name: str, host: int, argv: Sequence[str]) -> subprocess.Popen[str]:
        self._starts += 1
        log = open(self.folder / f"{name}.{self._starts}.log", "w")  # noqa: SIM115 (closed when the process ends)
        proc = self.hosts.run(host, argv, env=self.env, cwd=REPO, stdout=log)
        log.close()
        self.procs[name] = proc
        return proc

    def start_store(self) -> subprocess.Popen[str]:
        assert self.store_host is not None
        return self._start("store", self.store_host,
                           [sys.executable, "-m", "ds_recycle", "store", "--port", str(PORT)])

    def start_ssh(self) -> subprocess.Popen[str]:
        """Node 0's launcher on the first worker host; it starts the other nodes over ssh."""
        return self._start("node0", self.worker_hosts[0], [*self.launcher, *self.train])

    def start_node(self, node: int) -> subprocess.Popen[str]:
        """Node ``node``'s own launcher (``--no_ssh``), on its host; also how a lost host's launcher comes back."""
        return self._start(f"node{node}", self.worker_hosts[node],
                           [*self.launcher, "--no_ssh", "--node_rank", str(node), *self.train])

    def start_all_no_ssh(self) -> None:
        for node in range(len(self.worker_hosts)):
            self.start_node(node)

    # ---- watching ----------------------------------------------------------------------------------------------
    def metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_path.exists():
            return []
        lines = self.metrics_path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip().endswith("}")]

    def events(self, kind: type[E]) -> list[E]:
        """The events of type ``kind`` in the metrics so far, read through :mod:`ds_recycle.events`."""
        return events_of(self.metrics(), kind)

    def wait_iteration(self, iteration: int, timeout_s: float) -> dict[str, Any]:
        """The metrics record of ``iteration`` (0-based) once the reporter has written it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            recs = [r for r in self.metrics() if r["iter"] >= iteration]
            if recs:
                return recs[0]
            self._check_alive()
            time.sleep(0.1)
        raise AssertionError(f"iteration {iteration} not reached within {timeout_s} s\n{self.logs()}")

    def wait_event(self, kind: type[E], timeout_s: float, count: int = 1) -> list[E]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.events(kind)
            if len(found) >= count:
                return found
            time.sleep(0.1)
        raise AssertionError(f"no {kind.KIND!r} event within {timeout_s} s\n{self.logs()}")

    def _check_alive(self) -> None:
        if self.procs and all(p.poll() is not None for p in self.procs.values()):
            raise AssertionError(f"every launcher exited\n{self.logs()}")

    def wait(self, name: str, timeout_s: float) -> int:
        try:
            return self.procs[name].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} still runs after {timeout_s} s\n{self.logs()}") from None

    def finish(self, timeout_s: float) -> dict[str, int]:
        """Wait for every launcher (and the store service) to exit; their return codes."""
        deadline = time.monotonic() + timeout_s
        return {name: self.wait(name, max(1.0, deadline - time.monotonic())) for name in list(self.procs)}

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(f"===== {p.name}\n{p.read_text(errors='replace')[-tail:]}"
                         for p in sorted(self.folder.glob("*.log")))

    def text(self, name_prefix: str) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.folder.glob(f"{name_prefix}.*.log")))
