"""Real etcd clusters for the tests: ``n`` members of Debian's ``etcd`` (``launch/setup_hosts.sh`` installs
``etcd-server``), each in its own process and data directory, killed and restarted at will: on this host's
loopback, or one member per host of a :class:`~tests.nethosts.NetHosts` (on the host's address, ports 2379 and
2380; the member dies with its host's :meth:`~tests.nethosts.NetHosts.kill_host` and is asked from inside its
host's network namespace).

Elections are tuned for a test machine (heartbeat 50 ms, election timeout 500 ms; etcd's defaults are 100 ms and
1 s), so a lost leader is replaced within about a second. Members run with ``--pre-vote``, as docs/launcher.md asks
of a job's cluster: without it a member cut off from the others campaigns at ever higher terms, and when its link
comes back it deposes the leader; the election that follows leaves the other hosts without answers for long
enough to fence themselves (seen here: every host fenced after a healed partition).
"""
from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.nethosts import NetHosts

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

    def __init__(self, folder: Path, members: int = 3, hosts: NetHosts | None = None) -> None:
        if ETCD is None:
            raise RuntimeError("no etcd binary: run `sudo bash launch/setup_hosts.sh` (installs etcd-server)")
        self.folder = folder
        self.hosts = hosts
        if hosts is not None:
            members = hosts.n
            self.addrs = list(hosts.addrs)
            self.client_ports, self.peer_ports = [2379] * members, [2380] * members
        else:
            self.addrs = ["127.0.0.1"] * members
            ports = _free_ports(2 * members)
            self.client_ports, self.peer_ports = ports[:members], ports[members:]
        self.names = [f"m{i}" for i in range(members)]
        self.initial = ",".join(f"{n}=http://{a}:{p}" for n, a, p in zip(self.names, self.addrs, self.peer_ports))
        self.procs: list[subprocess.Popen[Any] | None] = [None] * members
        for i in range(members):
            self.start(i, new=True)
        self.wait_healthy(range(members), 30.0)

    @property
    def endpoints(self) -> str:
        return "etcd://" + ",".join(f"{a}:{p}" for a, p in zip(self.addrs, self.client_ports))

    def start(self, i: int, new: bool = False) -> None:
        """Start member ``i`` (again: with its data directory, it rejoins the cluster)."""
        name, addr, cport, pport = self.names[i], self.addrs[i], self.client_ports[i], self.peer_ports[i]
        argv = [str(ETCD), "--name", name, "--data-dir", str(self.folder / name),
                "--listen-client-urls", f"http://{addr}:{cport}", "--advertise-client-urls", f"http://{addr}:{cport}",
                "--listen-peer-urls", f"http://{addr}:{pport}", "--initial-advertise-peer-urls",
                f"http://{addr}:{pport}", "--initial-cluster", self.initial, "--initial-cluster-state",
                "new" if new else "existing", "--initial-cluster-token", f"t{self.folder.name}",
                "--heartbeat-interval", "50", "--election-timeout", "500", "--pre-vote"]
        log = open(self.folder / f"{name}.log", "ab")  # noqa: SIM115 (the process holds it)
        if self.hosts is None:
            self.procs[i] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        else:
            self.procs[i] = self.hosts.run(i, argv, stdout=log)  # type: ignore[arg-type]
        log.close()

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        self.procs[i] = None

    def _post(self, i: int, path: str, body: dict[str, Any] | None, timeout_s: float = 1.0) -> dict[str, Any] | None:
        """Member ``i``'s JSON answer to ``path`` (None: it does not answer); asked from inside its host's network
        namespace when it has one. ``body`` None: a GET."""
        url = f"http://{self.addrs[i]}:{self.client_ports[i]}{path}"
        if self.hosts is not None:
            script = ("import sys, urllib.request\ntry:\n    r = urllib.request.urlopen(urllib.request.Request("
                      "sys.argv[1], data=sys.argv[2].encode() or None, method='POST' if sys.argv[2] else 'GET'), "
                      "timeout=float(sys.argv[3]))\n    print(r.read().decode())\nexcept OSError:\n    print('null')\n")
            out = subprocess.run(["ip", "netns", "exec", self.hosts.names[i], sys.executable, "-c", script, url,
                                  "" if body is None else json.dumps(body), str(timeout_s)],
                                 capture_output=True, text=True, timeout=timeout_s + 30)
            answer = json.loads(out.stdout or "null")
            return dict(answer) if answer is not None else None
        request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                         method="GET" if body is None else "POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as reply:
                return dict(json.loads(reply.read()))
        except OSError:
            return None

    def status(self, i: int) -> dict[str, Any] | None:
        """Member ``i``'s ``/v3/maintenance/status`` (None: it does not answer)."""
        return self._post(i, "/v3/maintenance/status", {})

    def move_leader(self, to: int, timeout_s: float = 10.0) -> None:
        """Make member ``to`` the leader (etcd's leadership transfer, asked of the present leader)."""
        status = self.status(to)
        assert status is not None, f"etcd member {to} does not answer"
        target = status["header"]["member_id"]
        deadline = time.monotonic() + timeout_s
        while (now := self.leader(timeout_s)) != to:
            self._post(now, "/v3/maintenance/transfer-leadership", {"targetID": target}, timeout_s=5.0)
            if time.monotonic() > deadline:
                raise AssertionError(f"etcd member {to} did not become the leader within {timeout_s} s\n{self.logs()}")

    def leader(self, timeout_s: float = 10.0) -> int:
        """The index of the member that leads now (waits for an election)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for i in range(len(self.names)):
                st = self.status(i) if self.procs[i] is not None else None
                if st and st.get("leader") and st.get("leader") == st.get("header", {}).get("member_id"):
                    return i
            time.sleep(0.05)
        raise AssertionError(f"no etcd leader within {timeout_s} s\n{self.logs()}")

    def wait_healthy(self, members: range | list[int], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for i in members:
            while True:
                answer = self._post(i, "/health", None)
                if answer is not None and answer.get("health") == "true":
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"etcd member {i} not healthy within {timeout_s} s\n{self.logs()}")
                time.sleep(0.05)

    def logs(self, tail: int = 2000) -> str:
        return "\n".join(f"===== {p.name}\n{p.read_text(errors='replace')[-tail:]}"
                         for p in sorted(self.folder.glob("*.log")))

    def close(self) -> None:
        for i in range(len(self.procs)):
            self.kill(i)
