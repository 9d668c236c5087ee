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
``ds_recycle/generation``           ``"<g>"``: the job's generation (how many times every rank was started again);
                                    moved on with ``compare_set`` by whoever restarts the job.
``ds_recycle/gen<g>/started``       generation g's workers are past their start-up: every rank built its engine
                                    and the first epoch's groups. Before it, a lost rank cannot be recovered from
                                    (the others block in ``torch.distributed``'s and DeepSpeed's group building):
                                    the job starts again as generation g + 1 (:func:`request_start_up_restart`).
``ds_recycle/gen<g>/start_up_restart``  generation g is a restart of the previous one's start-up: each launcher
                                    SIGKILLs its ranks still running (blocked in the old start-up), then starts
                                    them again with the others (``restart_all``).
``ds_recycle/gen<g>/resilient``     a rank of generation g started a ds_recycle worker (``init_worker``): the job
                                    is one whose start-up may be restarted (a plain script under the launcher is
                                    never restarted as a whole).
``ds_recycle/gen<g>/start_up_deaths``  counter of ranks of generation g lost before its start-up was over.
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

__all__ = ["EXITS_KEY", "FENCE_REQUESTS_KEY", "GENERATION_ENV", "GENERATION_KEY", "JOB_OVER_KEY",
           "RESTART_ALL_KEY",
           "RESTART_REQUESTS_KEY", "STOP_KEY", "WORLD_SIZE_KEY", "begin_resilient_start_up", "carried_events_key",
           "connect_store", "exit_key", "exit_queue_key", "fallback_directory_key", "fence_key", "generation",
           "host_store", "is_etcd", "node_key", "note_start_up_death", "open_store", "publish_exit_count",
           "read_int", "request_start_up_restart", "resilient_key", "restart_request_key", "restart_result_key",
           "restarted_key", "start_up_deaths_key", "start_up_restart_key", "started_for_key", "started_key"]

EXITS_KEY = "ds_recycle/exits"
STOP_KEY = "ds_recycle/stop"
WORLD_SIZE_KEY = "ds_recycle/world_size"
RESTART_REQUESTS_KEY = "ds_recycle/restart_requests"
FENCE_REQUESTS_KEY = "ds_recycle/fence_requests"
RESTART_ALL_KEY = "ds_recycle/restart_all"
GENERATION_KEY = "ds_recycle/generation"
JOB_OVER_KEY = "ds_recycle/job_over"
"""The job's status, written by a launcher that reported it (a job of several hosts on etcd)."""
GENERATION_ENV = "DS_RECYCLE_GENERATION"
"""The generation a worker process was started for (its launcher sets it)."""


def started_key(generation: int) -> str:
    """Set once generation ``generation``'s start-up is over (see the table above)."""
    return f"ds_recycle/gen{generation}/started"


def start_up_restart_key(generation: int) -> str:
    return f"ds_recycle/gen{generation}/start_up_restart"


def fallback_directory_key(generation: int) -> str:
    """The checkpoint directory generation ``generation`` resumes from (a fallback names it)."""
    return f"ds_recycle/gen{generation}/fallback_directory"


def carried_events_key(generation: int) -> str:
    """The events a fallback hands to generation ``generation`` (JSON, :mod:`ds_recycle.resilience.fallback`)."""
    return f"ds_recycle/gen{generation}/carried_events"


def generation(store: Store) -> int:
    """The job's current generation (0 until the first restart of every rank)."""
    return int(store.add(GENERATION_KEY, 0))


def resilient_key(generation: int) -> str:
    return f"ds_recycle/gen{generation}/resilient"


def started_for_key(rank: int) -> str:
    """The generation ``rank``'s latest process was started for, written by its launcher at each start (the
    worker's own ``ds_recycle/rank_generation/<rank>`` says which generation's start-up it went through)."""
    return f"ds_recycle/started_for/{rank}"


def start_up_deaths_key(generation: int) -> str:
    return f"ds_recycle/gen{generation}/start_up_deaths"


def note_start_up_death(store: Store, generation: int) -> bool:
    """A launcher saw a rank of ``generation`` lost: count it if the start-up was not over, and restart every rank if
    the job is a ds_recycle one. True when a start-up restart stands.

    With :func:`begin_resilient_start_up` this is a handshake (each writes, then reads the other's key): a death
    before any rank said the job is resilient is found by the first one that says it."""
    if store.check([started_key(generation)]):
        return False
    store.add(start_up_deaths_key(generation), 1)
    return store.check([resilient_key(generation)]) and request_start_up_restart(store, generation)


def begin_resilient_start_up(store: Store, generation: int) -> bool:
    """A ds_recycle worker of ``generation`` begins its start-up; True when a rank was lost already (a start-up
    restart now stands: its launcher will SIGKILL this process)."""
    store.set(resilient_key(generation), "1")
    return int(store.add(start_up_deaths_key(generation), 0)) > 0 and request_start_up_restart(store, generation)


def request_start_up_restart(store: Store, dead_in: int) -> bool:
    """A rank of generation ``dead_in`` was lost before that generation's start-up was over: start every rank again
    as generation ``dead_in + 1``. True when the request stands (this call or a concurrent one for the same
    generation made it); False when the start-up was over (the failure handlers recover from the loss) or the job
    has moved on already."""
    if store.check([started_key(dead_in)]) or generation(store) != dead_in:
        return False
    if store.compare_set(GENERATION_KEY, str(dead_in), str(dead_in + 1)).decode() != str(dead_in + 1):
        return False
    for carried in (fallback_directory_key, carried_events_key):  # a fallback's start-up: the next one resumes alike
        if store.check([carried(dead_in)]):
            store.set(carried(dead_in + 1), store.get(carried(dead_in)).decode())
    store.set(start_up_restart_key(dead_in + 1), "1")
    store.set(RESTART_ALL_KEY, str(dead_in + 1))
    return True


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


def is_etcd(spec: str | None) -> bool:
    """True for a store given as ``etcd://host:port,...[/namespace]`` (``--store``)."""
    return bool(spec) and str(spec).startswith("etcd://")


def open_store(spec: str, timeout_s: float) -> Store:
    """A client of the job's store: ``host:port`` (the launcher's TCPStore) or ``etcd://h1:p1,h2:p2[/namespace]``
    (:class:`~ds_recycle.runtime.etcd_store.EtcdStore`)."""
    if is_etcd(spec):
        from ds_recycle.runtime.etcd_store import EtcdStore

        return EtcdStore(spec, timeout=timedelta(seconds=timeout_s))
    host, sep, port = spec.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"store {spec!r}: give host:port or etcd://host:port,host:port,host:port[/namespace]")
    return connect_store(host, int(port), timeout_s)


def read_int(store: Store, key: str) -> int | None:
    """The integer stored at ``key``, or None when the key is absent."""
    if not store.check([key]):
        return None
    return int(store.get(key).decode())
