"""Real etcd clusters for the tests: ``n`` members of Debian's ``etcd`` (``launch/setup_hosts.sh`` installs
``etcd-server``) on this host's loopback, each in its own process and data directory, killed and restarted at will.

Elections are tuned for a test machine (heartbeat 50 ms, election timeout 500 ms; etcd's defaults are 100 ms and
1 s), so a lost leader is replaced within about a second.
"""
from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

__all__ = ["ETCD", "EtcdCluster"]

ETCD = shutil.which("etcd")
"""The etcd server binary, or None where it is not installed."""


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class EtcdCluster:
    """``members`` etcd processes forming one cluster; :meth:`close` ends them all."""

    def __init__(self, folder: Path, members: int = 3) -> None:
        if ETCD is None:
            raise RuntimeError("no etcd binary: run `sudo bash launch/setup_hosts.sh` (installs etcd-server)")
        self.folder = folder
        ports = _free_ports(2 * members)
        self.client_ports, self.peer_ports = ports[:members], ports[members:]
        self.names = [f"m{i}" for i in range(members)]
        self.initial = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(self.names, self.peer_ports))
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * members
        for i in range(members):
            self.start(i, new=True)
        self.wait_healthy(range(members), 30.0)

    @property
    def endpoints(self) -> str:
        return "etcd://" + ",".join(f"127.0.0.1:{p}" for p in self.client_ports)

    def start(self, i: int, new: bool = False) -> None:
        """Start member ``i`` (again: with its data directory, it rejoins the cluster)."""
        name, cport, pport = self.names[i], self.client_ports[i], self.peer_ports[i]
        log = open(self.folder / f"{name}.log", "ab")  # noqa: SIM115 (the process holds it)
        self.procs[i] = subprocess.Popen(
            [str(ETCD), "--name", name, "--data-dir", str(self.folder / name),
             "--listen-client-urls", f"http://127.0.0.1:{cport}", "--advertise-client-urls", f"http://127.0.0.1:{cport}",
             "--listen-peer-urls", f"http://127.0.0.1:{pport}", "--initial-advertise-peer-urls",
             f"http://127.0.0.1:{pport}", "--initial-cluster", self.initial, "--initial-cluster-state",
             "new" if new else "existing", "--initial-cluster-token", f"t{self.peer_ports[0]}",
             "--heartbeat-interval", "50", "--election-timeout", "500"],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        self.procs[i] = None

    def status(self, i: int) -> dict[str, object] | None:
        """Member ``i``'s ``/v3/maintenance/status`` (None: it does not answer)."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.client_ports[i]}/v3/maintenance/status",
                                         data=b"{}", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=1.0) as answer:
                return dict(json.loads(answer.read()))
        except OSError:
            return None

    def leader(self, timeout_s: float = 10.0) -> int:
        """The index of the member that leads now (waits for an election)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for i in range(len(self.names)):
                st = self.status(i) if self.procs[i] is not None else None
                if st and st.get("leader") and st.get("leader") == st.get("header", {}).get("member_id"):  # type: ignore[union-attr]
                    return i
            time.sleep(0.05)
        raise AssertionError(f"no etcd leader within {timeout_s} s\n{self.logs()}")

    def wait_healthy(self, members: range | list[int], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for i in members:
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{self.client_ports[i]}/health", timeout=1.0) as r:
                        if json.loads(r.read()).get("health") == "true":
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(f"etcd member {i} not healthy within {timeout_s} s\n{self.logs()}")
                time.sleep(0.05)

    def logs(self, tail: int = 2000) -> str:
        return "\n".join(f"===== {p.name}\n{p.read_text(errors='replace')[-tail:]}"
                         for p in sorted(self.folder.glob("*.log")))

    def close(self) -> None:
        for i in range(len(self.procs)):
            self.kill(i)
