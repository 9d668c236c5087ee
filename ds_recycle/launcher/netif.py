"""Which network interface a node's workers give gloo, when the host name would send peers to loopback.

Gloo binds each worker to the address its host name resolves to, and tells its peers that address. On many
Debian installs, and in containers, the host name resolves to ``127.0.0.1``/``127.0.1.1``: every worker then
advertises loopback, and a peer on another host cannot connect (``Gloo connectFullMesh failed ... Connection
refused, remote=[127.0.0.1]``). In a job of several nodes, when neither ``GLOO_SOCKET_IFNAME`` nor
``TP_SOCKET_IFNAME`` is set and the host name resolves to loopback, each node's launcher sets
``GLOO_SOCKET_IFNAME`` for its workers to the interface this host uses to reach the store (the route to
``--master_addr``), and logs it. Set ``GLOO_SOCKET_IFNAME`` yourself to choose another.
"""
from __future__ import annotations

import fcntl
import ipaddress
import logging
import socket
import struct
from collections.abc import Mapping

__all__ = ["gloo_interface_env", "interface_of", "local_address_towards"]

logger = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915
_CHOSEN_BY_USER = ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")


def _resolves_to_loopback(name: str) -> bool:
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET)
    except OSError:
        return True  # gloo falls back to loopback too
    return all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def local_address_towards(addr: str) -> str:
    """This host's IPv4 address on the route to ``addr`` (no packet is sent: a UDP socket is only connected)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((addr, 9))
        return str(sock.getsockname()[0])


def interface_of(local_addr: str) -> str | None:
    """The name of the interface holding IPv4 address ``local_addr``, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this one
            if socket.inet_ntoa(raw[20:24]) == local_addr:
                return name
    return None


def gloo_interface_env(master_addr: str, env: Mapping[str, str], several_nodes: bool,
                       hostname: str | None = None) -> dict[str, str]:
    """``{"GLOO_SOCKET_IFNAME": IFACE}`` when the workers need it (see the module docstring), else ``{}``."""
    name = hostname if hostname is not None else socket.gethostname()
    if not several_nodes or any(key in env for key in _CHOSEN_BY_USER) or not _resolves_to_loopback(name):
        return {}
    try:
        local = local_address_towards(master_addr)
    except OSError as err:
        logger.warning("host name %r resolves to loopback and no route to %s was found (%s): set "
                       "GLOO_SOCKET_IFNAME to the interface the other hosts reach", name, master_addr, err)
        return {}
    if ipaddress.ip_address(local).is_loopback:
        return {}  # the store is on this machine's loopback: every node is this machine, loopback is right
    iface = interface_of(local)
    if iface is None:
        return {}
    logger.info("host name %r resolves to loopback: workers bind gloo to %s (%s, the route to the store at %s); "
                "set GLOO_SOCKET_IFNAME to choose another interface", name, iface, local, master_addr)
    return {"GLOO_SOCKET_IFNAME": iface}
