"""The job's store schema: the keys the launchers and the workers share, and how both connect to the store.

The store is hosted by the launcher of node 0 (or by ``ds-recycle store``) so that it outlives every worker. It
lives in this lower layer because both sides use it: the launcher (process supervision) and the failure handler.

Keys the launchers write (the failure handler of the workers reads them; all values are UTF-8 text):

==================================  ==============================================================================
``ds_recycle/exit/<rank>``          return code of the rank's exit: ``"0"``, ``"1"``, ``"-9"`` (negative: the
                                    signal that killed it). Written the moment its launcher reaps it (or ``"75"``
                                    by the node watch when the rank's node is declared lost); deleted when the
                                    rank is restarted, so the key exists iff the rank's process is gone.
``ds_recycle/exits``                counter (``store.add``) of exits so far, over all ranks and restarts; a worker
                                    can poll it cheaply and read the ``exit/<rank>`` keys when it changes.
``ds_recycle/exit_queue/<r>``       a queue (``queue_push``/``queue_pop``): at each exit the launcher pushes the
                                    new count onto every rank's queue, so a worker blocks in ``queue_pop`` on
                                    its own instead of polling the counter (see :func:`publish_exit_count`).
``ds_recycle/restarted/<r>``        ``"<n>"``: rank r was started again for the n-th time (written just before).
``ds_recycle/node/<k>``             host name of node k's launcher, written when it has connected to a store
                                    it does not host (nodes > 0; node 0 too with a ``ds-recycle store``).
``ds_recycle/stop``                 reason text: a launcher is stopping the whole job. Every launcher polls it
                                    (every 0.25 s) and stops its own workers; a worker may read it, or set it
                                    to stop the job.
``ds_recycle/world_size``           ``"<n>"``: the job's number of ranks, written by node 0 before it starts
                                    any worker (``ds-recycle restart`` checks its ranks against it).
``ds_recycle/restart_request/<r>``  a request id (one line of text): "restart rank r now". Written with
                                    ``compare_set`` (one pending request per rank), then ``restart_requests`` is
                                    incremented; the launcher that runs rank r answers within 0.25 s and then
                                    deletes the key. ``ds-recycle restart`` writes it.
``ds_recycle/restart_requests``     counter (``store.add``) of restart requests so far: each launcher polls
                                    it and reads its ranks' request keys only when it has changed.
``ds_recycle/restart_result/<r>``   the answer to the latest request for rank r: the JSON of a
                                    :class:`~ds_recycle.launcher.restart_requests.RestartResult` (request id,
                                    restarted or refused and why, the new pid, the restart count).
``ds_recycle/fence/<r>``            ``"<n> <reason>"``: rank r's process of restart count n is hung (its heartbeat
                                    stopped); its launcher SIGKILLs it and reports its death as usual, then
                                    deletes the key. Written by a member's watchdog, then ``fence_requests``
                                    is incremented.
``ds_recycle/restart_all``          ``"<g>"``: the job falls back to its checkpoint as generation g. Every launcher
                                    starts each of its ranks again once it is lost (at once, within
                                    ``--max_restarts``), whether or not ``--restart_failed_after`` is set.
``ds_recycle/fence_requests``       counter (``store.add``) of fence requests so far, polled like
                                    ``restart_requests``.
==================================  ==============================================================================

The keys of hosts as units of failure (node heartbeats, ``node_lost``, the job's layout and node timeout, host
events) are described in :mod:`ds_recycle.launcher.hostwatch`; every key, with who writes it, is listed in
``docs/launcher.md``.

Workers reach the store at ``DS_RECYCLE_STORE`` (``host:port``, the same as ``MASTER_ADDR:MASTER_PORT``);
torch's env:// rendezvous connects to it as a client because the launcher sets
``TORCHELASTIC_USE_AGENT_STORE=True``. torch puts its own keys under the ``default_pg`` prefix.
"""
from __future__ import annotations

import socket
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported only when a store is opened, so the key names cost nothing to import
    from torch.distributed import Store, TCPStore

__all__ = ["EXITS_KEY", "FENCE_REQUESTS_KEY", "RESTART_ALL_KEY", "RESTART_REQUESTS_KEY", "STOP_KEY", "WORLD_SIZE_KEY",
           "connect_store", "exit_key", "exit_queue_key", "fence_key", "host_store", "node_key", "publish_exit_count",
           "read_int", "restart_request_key", "restart_result_key", "restarted_key"]

EXITS_KEY = "ds_recycle/exits"
STOP_KEY = "ds_recycle/stop"
WORLD_SIZE_KEY = "ds_recycle/world_size"
RESTART_REQUESTS_KEY = "ds_recycle/restart_requests"
FENCE_REQUESTS_KEY = "ds_recycle/fence_requests"
RESTART_ALL_KEY = "ds_recycle/restart_all"


def exit_key(rank: int) -> str:
    return f"ds_recycle/exit/{rank}"


def exit_queue_key(rank: int) -> str:
    """Rank ``rank``'s queue of exit counts (its watchdog pops it; see :func:`publish_exit_count`)."""
    return f"ds_recycle/exit_queue/{rank}"


def publish_exit_count(store: Store, world_size: int) -> int:
    """Count one more exit (its ``exit/<rank>`` keys written already) and wake every rank's watchdog.

    Returns the new count. Each rank's queue gets one item per exit: a rank that is not there to pop them finds
    at most that many stale items, each costing its watchdog one read of the counter.
    """
    count = int(store.add(EXITS_KEY, 1))
    for rank in range(world_size):
        store.queue_push(exit_queue_key(rank), str(count))
    return count


def fence_key(rank: int) -> str:
    return f"ds_recycle/fence/{rank}"


def node_key(node_rank: int) -> str:
    return f"ds_recycle/node/{node_rank}"


def restarted_key(rank: int) -> str:
    return f"ds_recycle/restarted/{rank}"


def restart_request_key(rank: int) -> str:
    return f"ds_recycle/restart_request/{rank}"


def restart_result_key(rank: int) -> str:
    return f"ds_recycle/restart_result/{rank}"


def host_store(addr: str, port: int, timeout_s: float) -> TCPStore:
    """Start the store's server in this process (``port`` 0 picks a free one: read ``store.port``).

    When ``addr`` is an IPv4 address the server listens on an IPv4 socket of ours (every IPv4 interface): torch's
    own dual-stack socket sees each client as an IPv6-mapped address, whose name it looks up for its logs in DNS
    (``/etc/hosts`` does not answer for mapped addresses), and the server answers nobody while a lookup waits.
    A resolver that drops a query then stalls the whole store for its timeout (5 s by default); over IPv4,
    loopback and the hosts file's addresses are answered locally.
    """
    from torch.distributed import TCPStore

    try:
        fd = None
        if _is_ipv4(addr):
            fd, port = _ipv4_listener(port)
        if fd is None:
            return TCPStore(addr, port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)
        return TCPStore(addr, port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False,
                        master_listen_fd=fd)
    except (RuntimeError, OSError) as err:
        raise OSError(f"cannot host the store on {addr}:{port} ({err}); "
                      f"pick a free --master_port, or --master_port 0 for any free port") from err


def _is_ipv4(addr: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET, addr)
    except OSError:
        return False
    return True


def _ipv4_listener(port: int) -> tuple[int, int]:
    """A listening IPv4 socket on every interface at ``port`` (0: any free one): its descriptor (owned by the
    store from now on) and its port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0", port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    port = sock.getsockname()[1]
    return sock.detach(), port


def connect_store(addr: str, port: int, timeout_s: float) -> TCPStore:
    """Connect to the job's store as a client (launchers that do not host it, workers, ``ds-recycle restart``),
    waiting up to ``timeout_s`` for it."""
    from torch.distributed import TCPStore

    try:
        return TCPStore(addr, port, None, False, timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as err:
        raise OSError(f"cannot reach the store of node 0 at {addr}:{port} within {timeout_s} s ({err}); "
                      f"check --master_addr/--master_port and that node 0's launcher runs") from err


def read_int(store: Store, key: str) -> int | None:
    """The integer stored at ``key``, or None when the key is absent."""
    if not store.check([key]):
        return None
    return int(store.get(key).decode())
