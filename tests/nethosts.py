"""Several hosts on one machine: Linux network namespaces on a private bridge, each with its own sshd.

A :class:`NetHosts` makes ``n`` hosts ``h0..h(n-1)`` and one switch, all network namespaces it creates itself
(names carry this process's pid, so several harnesses can run side by side). The switch namespace holds a
bridge; each host has one veth link to it, its own loopback, the address ``10.213.0.<k+1>/24`` and an sshd
(Debian's ``/usr/sbin/sshd``) listening on that address only, with a host key and a client key made for this
harness in its folder. No address exists outside these namespaces and the namespaces have no route anywhere
else, so nothing leaves the machine. The file system is the machine's, as with a shared home directory on a
cluster: the same working directory and interpreter path on every host.

What a test can do to a host: :meth:`run` a command in it (``ip netns exec``), :meth:`kill_host` (SIGKILL to
every process of its namespace at once: its launcher, its workers and its sshd, as when a machine dies; then
:meth:`revive` starts its sshd again), :meth:`cut` and :meth:`heal` its link (the switch's end of its veth goes
down: its processes live on and see no error, their packets are dropped), and :meth:`slow` its link
(``tc netem`` delay where the kernel has it, else a ``tbf`` rate limit, which queues packets). :meth:`close`
removes everything, processes first, and is safe to call twice; use the object as a context manager so a
failing test tears down too. Needs root (``ip netns add``); :func:`namespaces_refused` says why not.

    with NetHosts(3, tmp_path) as hosts:
        hosts.hostfile(2)                      # '10.213.0.1 slots=2' ... for ds-recycle launch --hostfile
        proc = hosts.run(0, [sys.executable, "-m", "ds_recycle", "launch", "--hostfile", ...], env=hosts.env())
        hosts.cut(1); ...; hosts.heal(1)
"""
from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

__all__ = ["NetHosts", "SSHD", "namespaces_refused"]

SSHD = "/usr/sbin/sshd"
_SUBNET = "10.213.0"
_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def namespaces_refused() -> str | None:
    """Why this machine cannot run the harness (None when it can): not root, no ``ip``, no sshd, netns refused."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2); run `bash launch/setup_hosts.sh` as root"
    if not os.path.exists(SSHD):
        return f"no {SSHD}; run `bash launch/setup_hosts.sh` as root (installs openssh-server)"
    probe = f"dsrprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"the kernel refused a network namespace (`ip netns add`: {made.stderr.strip()}); needs root"
    _ip("netns", "del", probe, check=False)
    return None


class NetHosts:
    """``n`` hosts as network namespaces on a private bridge, each running sshd; see the module docstring."""

    def __init__(self, n: int, folder: Path) -> None:
        if not 1 <= n <= 8:
            raise ValueError(f"NetHosts({n}): give 1..8 hosts")
        self.n = n
        self.tag = f"dsr{os.getpid()}x{next(_counter)}"
        self.folder = Path(folder) / self.tag
        self.switch = f"{self.tag}sw"
        self.names = [f"{self.tag}h{k}" for k in range(n)]
        self.addrs = [f"{_SUBNET}.{k + 1}" for k in range(n)]
        self._sshd: dict[int, subprocess.Popen[bytes]] = {}
        self._made: list[str] = []
        self.slow_kind: dict[int, str] = {}

    # ---- set-up and teardown ---------------------------------------------------------------------------------
    def __enter__(self) -> NetHosts:
        try:
            self._make_network()
            self._make_keys()
            for k in range(self.n):
                self._start_sshd(k)
            for k in range(self.n):
                self._wait_ssh(k)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _make_network(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        for ns in (self.switch, *self.names):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for k, ns in enumerate(self.names):
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{k}", "netns", self.switch)
            _ip("-n", self.switch, "link", "set", f"p{k}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"p{k}", "up")
            _ip("-n", ns, "addr", "add", f"{self.addrs[k]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def _make_keys(self) -> None:
        keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", ""]
        subprocess.run([*keygen, "-f", str(self.folder / "host_key")], check=True, timeout=30)
        subprocess.run([*keygen, "-f", str(self.folder / "id")], check=True, timeout=30)
        shutil.copy(self.folder / "id.pub", self.folder / "authorized_keys")
        host_pub = (self.folder / "host_key.pub").read_text().split()
        (self.folder / "known_hosts").write_text("".join(f"{a} {host_pub[0]} {host_pub[1]}\n" for a in self.addrs))
        (self.folder / "ssh_config").write_text(
            "Host *\n"
            f"  IdentityFile {self.folder / 'id'}\n  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {self.folder / 'known_hosts'}\n  StrictHostKeyChecking yes\n"
            "  BatchMode yes\n  User root\n  LogLevel ERROR\n  ConnectTimeout 10\n")
        bin_dir = self.folder / "bin"
        bin_dir.mkdir(exist_ok=True)
        wrapper = bin_dir / "ssh"  # the launcher runs `ssh`; this one is OpenSSH's client with the harness's keys
        wrapper.write_text(f"#!/bin/sh\nexec /usr/bin/ssh -F {self.folder / 'ssh_config'} \"$@\"\n")
        wrapper.chmod(0o755)

    def _start_sshd(self, k: int) -> None:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # Debian's sshd insists on its privilege-separation dir
        config = self.folder / f"sshd{k}.conf"
        config.write_text(
            f"ListenAddress {self.addrs[k]}\nPort 22\nHostKey {self.folder / 'host_key'}\n"
            f"AuthorizedKeysFile {self.folder / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
            f"PidFile {self.folder / f'sshd{k}.pid'}\nPrintMotd no\n")
        log = open(self.folder / f"sshd{k}.log", "ab")  # noqa: SIM115 (lives as long as the sshd)
        self._sshd[k] = subprocess.Popen(["ip", "netns", "exec", self.names[k], SSHD, "-D", "-e", "-f", str(config)],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        log.close()

    def _wait_ssh(self, k: int, timeout_s: float = 30.0) -> None:
        """Until ``ssh`` from host 0 to host ``k`` runs a command (sshd is up and the keys work)."""
        deadline = time.monotonic() + timeout_s
        while True:
            probe = subprocess.run(["ip", "netns", "exec", self.names[0], str(self.folder / "bin" / "ssh"),
                                    self.addrs[k], "true"], capture_output=True, text=True, timeout=30)
            if probe.returncode == 0:
                return
            if time.monotonic() > deadline:
                log = (self.folder / f"sshd{k}.log").read_text(errors="replace")
                raise RuntimeError(f"ssh to host {k} ({self.addrs[k]}) fails: {probe.stderr.strip()}\nsshd: {log}")
            time.sleep(0.2)

    def close(self) -> None:
        """Kill every process of every namespace, then delete the namespaces (their links go with them)."""
        for k in range(self.n):
            if self.names[k] in self._made:
                self.kill_host(k)
        for proc in self._sshd.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._sshd.clear()
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()

    # ---- what tests do -----------------------------------------------------------------------------------------
    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """This process's environment with the harness's ``ssh`` first on PATH (for node 0's launcher)."""
        return {**os.environ, "PATH": f"{self.folder / 'bin'}:{os.environ.get('PATH', '')}", **(extra or {})}

    def hostfile(self, slots: int, hosts: Sequence[int] | None = None, name: str = "hostfile") -> Path:
        """A `deepspeed`-style hostfile naming the hosts by address, ``slots`` each."""
        path = self.folder / name
        path.write_text("".join(f"{self.addrs[k]} slots={slots}\n" for k in (hosts or range(self.n))))
        return path

    def run(self, k: int, argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: Path | None = None,
            stdout: IO[str] | int | None = subprocess.PIPE) -> subprocess.Popen[str]:
        """Start ``argv`` on host ``k`` (inside its namespace), in a session of its own, output merged."""
        return subprocess.Popen(["ip", "netns", "exec", self.names[k], *argv], env=dict(env or os.environ), cwd=cwd,
                                stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)

    def pids(self, k: int) -> list[int]:
        """Every process whose network namespace is host ``k``'s."""
        out = _ip("netns", "pids", self.names[k], check=False).stdout
        return [int(p) for p in out.split()]

    def kill_host(self, k: int) -> list[int]:
        """SIGKILL every process of host ``k`` at once (repeated until none is left); returns the first pids."""
        first = self.pids(k)
        pids = first
        for _ in range(50):
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
            pids = self.pids(k)
        sshd = self._sshd.pop(k, None)
        if sshd is not None:
            sshd.wait(timeout=10)
        return first

    def revive(self, k: int) -> None:
        """Host ``k`` boots again after :meth:`kill_host`: its sshd runs and takes logins."""
        self._start_sshd(k)
        self._wait_ssh(k)

    def cut(self, k: int) -> None:
        """Cut host ``k``'s link at the switch: its processes live, its packets go nowhere."""
        _ip("-n", self.switch, "link", "set", f"p{k}", "down")

    def heal(self, k: int) -> None:
        """Put host ``k``'s link back."""
        _ip("-n", self.switch, "link", "set", f"p{k}", "up")

    def slow(self, k: int, delay_ms: int, rate_mbit: float = 2.0) -> str:
        """Slow host ``k``'s outgoing traffic: ``netem delay`` if the kernel has it, else a ``tbf`` rate limit.

        Returns what was applied. The ``tbf`` fallback (``rate_mbit``, a 200 ms queue) delays bulk transfers, not
        every packet.
        """
        dev = ["dev", "eth0", "root"]
        netem = self._tc(k, "qdisc", "add", *dev, "netem", "delay", f"{delay_ms}ms", check=False)
        if netem.returncode == 0:
            self.slow_kind[k] = f"netem delay {delay_ms}ms"
        else:
            rate = f"{int(rate_mbit * 1000)}kbit"
            self._tc(k, "qdisc", "add", *dev, "tbf", "rate", rate, "burst", "32kbit", "latency", "200ms")
            self.slow_kind[k] = f"tbf rate {rate} latency 200ms (no netem in this kernel)"
        return self.slow_kind[k]

    def unslow(self, k: int) -> None:
        self._tc(k, "qdisc", "del", "dev", "eth0", "root", check=False)
        self.slow_kind.pop(k, None)

    def _tc(self, k: int, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", self.names[k], "tc", *args], capture_output=True, text=True,
                              check=check, timeout=30)
