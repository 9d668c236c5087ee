"""The job's store: hosted on an IPv4 socket for an IPv4 address (no reverse DNS lookup of mapped addresses)."""
from __future__ import annotations

from pathlib import Path

import pytest

from ds_recycle.runtime.job_store import connect_store, host_store


def _ipv4_listening_ports() -> set[int]:
    """Ports with a listening socket in ``/proc/net/tcp`` (IPv4 sockets only; IPv6 ones are in ``tcp6``)."""
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return {int(row[1].rsplit(":", 1)[1], 16) for row in rows if row[3] == "0A"}


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
def test_the_store_listens_on_ipv4_for_an_ipv4_address_and_serves_clients() -> None:
    """Torch's own dual-stack socket sees an IPv4 client as ``::ffff:a.b.c.d`` and looks its name up in DNS for its
    logs; the server answers nobody meanwhile, so a dropped query stalls the whole store. An IPv4 socket of ours
    sees plain IPv4 addresses, which the hosts file answers."""
    store = host_store("127.0.0.1", 0, 10.0)
    assert store.port in _ipv4_listening_ports()
    client = connect_store("127.0.0.1", store.port, 10.0)
    client.set("k", "v")
    assert store.get("k") == b"v" and client.add("n", 2) == 2
    with pytest.raises(OSError, match="Address already in use"):
        host_store("127.0.0.1", store.port, 5.0)
