"""``ds-recycle launch``: the `deepspeed` launcher's command line, with workers that survive each other.

    ds-recycle launch --num_accelerators 4 train.py --deepspeed_config cfg.json
    ds-recycle launch --num_gpus 2 --master_port 0 --log_ranks 0 train.py
    ds-recycle launch --hostfile hosts --include "worker-0@worker-1:0,1" --master_addr 10.0.0.1 train.py
    ds-recycle launch --strict --module my_pkg.train --steps 10       # --strict: any death stops the job
    ds-recycle launch --dry_run --hostfile hosts train.py        # print the layout and the commands only
    ds-recycle restart --master_port 29500 3      # start lost rank 3 of the running job again, now

``docs/launcher.md`` describes the environment each worker gets, the exit rules, restarts and several hosts.
"""
from __future__ import annotations

import argparse
import logging
import os
import shlex
import socket
import sys
from typing import TYPE_CHECKING

from ds_recycle.launcher.forkserver import ForkServer
from ds_recycle.launcher.hosts import Layout, resolve_layout
from ds_recycle.launcher.job import JobSpec, Program, worker_specs
from ds_recycle.launcher.netif import gloo_interface_env
from ds_recycle.launcher.policy import ExitPolicy
from ds_recycle.launcher.remote import default_env_files, exported_env, ssh_command
from ds_recycle.launcher.worker import OutputSink, Worker, WorkerSpec, pdeathsig_argv

if TYPE_CHECKING:
    from torch.distributed import Store

__all__ = ["add_arguments", "run", "build_job"]

logger = logging.getLogger("ds_recycle.launcher")

_DEFAULT_PORT = 29500
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_argument_group("where the workers run (the `deepspeed` launcher's options)")
    where.add_argument("-H", "--hostfile", default=None, help="'HOST slots=N' per line; default: this host only")
    where.add_argument("-i", "--include", default="", help='hosts/slots to use, e.g. "worker-0@worker-1:0,2"')
    where.add_argument("-e", "--exclude", default="", help='hosts/slots to leave out, e.g. "worker-1:0"')
    where.add_argument("--num_nodes", type=int, default=None, help="use the first N hosts of the hostfile")
    where.add_argument("--num_accelerators", "--num_gpus", dest="num_accelerators", type=int, default=None,
                       help="workers per host (default: the visible CUDA devices, or 1 without CUDA)")
    where.add_argument("--master_addr", default=None,
                       help="address of node 0's store (default: 127.0.0.1; with several hosts, the first host)")
    where.add_argument("--master_port", type=int, default=_DEFAULT_PORT, help="store port; 0 picks a free one")
    where.add_argument("--ssh_port", type=int, default=None, help="ssh port of the other hosts")
    where.add_argument("--no_ssh", action="store_true",
                       help="start no other node: run `ds-recycle launch --no_ssh --node_rank K ...` on each node "
                            "yourself, with the same hostfile and a fixed --master_port")
    where.add_argument("--node_rank", type=int, default=0, help="this node's index in the layout (with --no_ssh)")
    where.add_argument("--world_info", default=None, help=argparse.SUPPRESS)
    where.add_argument("--store_timeout", type=float, default=120.0,
                       help="seconds a launcher waits for a store it does not host (with --no_ssh, node 0 waits as "
                            "long for the other nodes to connect), and a node cut off from the store waits for it "
                            "before it leaves as lost (default 120)")
    where.add_argument("--store_service", action="store_true",
                       help="the store at --master_addr:--master_port is a `ds-recycle store` service (on a host "
                            "with no workers): node 0 connects to it instead of hosting it, so node 0 can be lost")
    where.add_argument("--store", default=None, metavar="etcd://HOST:PORT,...[/NAMESPACE]",
                       help="keep the job's coordination on this etcd cluster (v3 API; give every member) instead "
                            "of a TCPStore in node 0's launcher; the namespace (default ds-recycle) is cleared when "
                            "the job starts. One host for now")
    where.add_argument("--node_timeout", type=float, default=10.0,
                       help="a node whose launcher's heartbeat has not reached the store for this long is lost: "
                            "its ranks count as lost; a node cut off from the store SIGKILLs its own workers "
                            "after half of it (default 10)")

    how = parser.add_argument_group("how each worker runs")
    how.add_argument("--threads_per_worker", type=int, default=None,
                     help="OMP/MKL threads per worker unless OMP_NUM_THREADS is set (default: 1 without CUDA, "
                          "untouched with CUDA); 0: leave them alone")
    how.add_argument("--log_ranks", default=None, help="show only these ranks' stdout, e.g. 0,1 (stderr: all)")
    how.add_argument("--module", action="store_true", help="run the target as `python -m TARGET`")
    how.add_argument("--no_python", action="store_true", help="the target is an executable, not a Python file")
    how.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank=N to the script")
    how.add_argument("--dry_run", action="store_true", help="print the layout and the commands, start nothing")
    how.add_argument("--preload", choices=("auto", "on", "off"), default="auto",
                     help="fork each Python worker (and each restart) from a process that imported torch and "
                          "DeepSpeed once, instead of starting it from scratch (about 2.5 s of CPU less each); "
                          "auto (default): on where no CUDA device is visible. Not on CUDA machines yet: a parent "
                          "that touched CUDA cannot fork workers that use it")

    fail = parser.add_argument_group("failures (see `ds_recycle.launcher.policy`)")
    fail.add_argument("--strict", action="store_true", help="any worker's death or error stops the whole job")
    fail.add_argument("--error_grace", type=float, default=30.0,
                      help="after a worker's error exit, seconds the others get before SIGTERM (default 30)")
    fail.add_argument("--kill_grace", type=float, default=5.0, help="seconds from SIGTERM to SIGKILL (default 5)")
    fail.add_argument("--restart_failed_after", type=float, default=None,
                      help="start a lost rank again after this many seconds (default: never; a lost rank then "
                           "stays down until `ds-recycle restart RANK`)")
    fail.add_argument("--max_restarts", type=int, default=3,
                      help="restarts per rank, timed or on command (default 3)")

    parser.add_argument("user_script", help="the training script (a module with --module, an executable with --no_python)")
    parser.add_argument("user_args", nargs=argparse.REMAINDER, help="the script's own arguments")


def _parse_log_ranks(text: str | None) -> frozenset[int] | None:
    if text is None:
        return None
    try:
        return frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"--log_ranks {text!r}: give rank numbers separated by commas, e.g. 0,3") from None


def _layout(args: argparse.Namespace, local_slots: int) -> Layout:
    if args.world_info is not None:
        return Layout.decode(args.world_info)
    if args.node_rank != 0 and not args.no_ssh:
        raise ValueError(f"--node_rank {args.node_rank} needs --no_ssh (node 0 starts the other nodes over ssh)")
    if args.node_rank != 0 and args.master_port == 0:
        raise ValueError("--master_port 0 on a node other than 0: give node 0's actual store port")
    return resolve_layout(args.hostfile, args.include, args.exclude, args.num_nodes, args.num_accelerators,
                          local_slots)


def _master_addr(args: argparse.Namespace, layout: Layout) -> str:
    multi = len(layout.nodes) > 1
    addr = args.master_addr or (layout.nodes[0].host if multi else "127.0.0.1")
    if multi and addr in _LOOPBACK and not args.no_ssh:
        raise ValueError(f"--master_addr {addr!r}: the other hosts cannot reach node 0 there; "
                         f"give node 0's address as the other hosts see it")
    return addr


def build_job(args: argparse.Namespace, master_port: int, cuda_devices: int) -> JobSpec:
    """The job the options describe (``master_port`` is the store's real port; bad options raise ValueError)."""
    layout = _layout(args, max(cuda_devices, 1))
    if not 0 <= args.node_rank < len(layout.nodes):
        raise ValueError(f"--node_rank {args.node_rank} is outside the job's {len(layout.nodes)} node(s)")
    threads = args.threads_per_worker if args.threads_per_worker is not None else (0 if cuda_devices else 1)
    if threads < 0:
        raise ValueError(f"--threads_per_worker {threads}: give 1 or more, or 0 for 'leave alone'")
    program = Program(args.user_script, tuple(args.user_args), args.module, args.no_python, not args.no_local_rank)
    if not (program.module or program.no_python or os.path.isfile(program.target)):
        raise ValueError(f"the script {program.target!r} does not exist in {os.getcwd()}; "
                         f"give its path, or use --module / --no_python")
    policy = ExitPolicy(args.strict, args.error_grace, args.kill_grace, args.restart_failed_after, args.max_restarts)
    log_ranks = _parse_log_ranks(args.log_ranks)
    if log_ranks is not None and not log_ranks <= set(range(layout.world_size)):
        raise ValueError(f"--log_ranks {args.log_ranks}: the job has ranks 0..{layout.world_size - 1}")
    master_addr = _master_addr(args, layout)
    env = {**os.environ, **gloo_interface_env(master_addr, os.environ, len(layout.nodes) > 1)}
    job = JobSpec(layout, args.node_rank, master_addr, master_port, program, policy,
                  threads or None, log_ranks, env, cuda_available=cuda_devices > 0,
                  node_timeout_s=args.node_timeout, store_service=args.store_service,
                  store=_etcd_spec(args, layout))
    worker_specs(job)  # raises ValueError now for what only the per-rank environment can reveal
    return job


def _etcd_spec(args: argparse.Namespace, layout: Layout) -> str | None:
    """``--store`` checked and with its namespace (None: the launcher's own TCPStore)."""
    if args.store is None:
        return None
    from ds_recycle.runtime.etcd_store import normal_spec

    spec = normal_spec(args.store)
    if args.store_service:
        raise ValueError("--store and --store_service name two stores: give one")
    return spec


def _remote_workers(job: JobSpec, args: argparse.Namespace, sink: OutputSink) -> list[Worker]:
    env = exported_env(os.environ, default_env_files())
    return [Worker(WorkerSpec(f"node {k} on {node.host}", None, tuple(ssh_command(job, k, os.getcwd(), env,
                                                                                args.ssh_port)), dict(os.environ)),
                   sink) for k, node in enumerate(job.layout.nodes) if k > 0]


def _print_dry_run(job: JobSpec, args: argparse.Namespace) -> None:
    for k, node in enumerate(job.layout.nodes):
        first = job.layout.offset(k)
        print(f"node {k}: {node.host} slots {list(node.slots)} ranks {first}..{first + len(node.slots) - 1}")
    for spec in worker_specs(job):
        print(f"{spec.name}: {shlex.join(spec.argv)}")
    for remote in [] if args.no_ssh else _remote_workers(job, args, OutputSink(sys.stdout)):
        print(f"{remote.spec.name}: {shlex.join(remote.spec.argv)}")


def _warn_if_node0_elsewhere(job: JobSpec) -> None:
    """Node 0's workers run here; say so when the layout's first host does not look like this machine."""
    host = job.layout.nodes[0].host
    here = {"localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn(), socket.gethostname().split(".")[0]}
    if job.node_rank == 0 and host not in here:
        logger.warning("node 0 is %r in the layout, but its workers run here on %r: start `ds-recycle launch` on "
                       "the first host of the hostfile", host, socket.gethostname())


def _setup_logging(node_rank: int) -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format=f"[ds-recycle launch node {node_rank}] %(asctime)s %(levelname)s %(message)s")


def _open_store(job: JobSpec, args: argparse.Namespace) -> Store:
    """Node 0 hosts the store (``--master_port 0``: any free port); other nodes connect and announce themselves.
    With ``--store etcd://...`` the store is the etcd cluster: node 0 clears the job's namespace."""
    from ds_recycle.runtime import job_store as stores

    if job.store is not None:
        from ds_recycle.launcher.etcd_job import open_etcd_job

        return open_etcd_job(job, args.store_timeout)
    if job.node_rank == 0 and not job.store_service:
        return stores.host_store(job.master_addr, args.master_port, args.store_timeout)
    if args.master_port == 0:
        raise OSError("--master_port 0 with a store this launcher does not host: give the store's port")
    store = stores.connect_store(job.master_addr, args.master_port, args.store_timeout)
    try:
        store.set(stores.node_key(job.node_rank), socket.gethostname())
    except RuntimeError as err:
        raise OSError(f"node 0's store at {job.master_addr}:{args.master_port} went away: {err}") from err
    return store


def run(args: argparse.Namespace) -> int:
    _setup_logging(args.node_rank)
    server = _early_fork_server(args)  # imports torch and DeepSpeed while this process imports torch and opens the store
    try:
        code, clean = _run(args, server)
    finally:
        if server is not None:
            server.close()
    if not clean:  # a lease thread blocked in the store: the interpreter's shutdown would abort inside its C++ call
        logger.warning("the store did not answer the lease's last call: leaving without interpreter shutdown")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _run(args: argparse.Namespace, server: ForkServer | None) -> tuple[int, bool]:
    """The job's exit code, and False when a lease thread outlived it (see :meth:`Lease.stop`)."""
    import torch  # deferred: `ds-recycle launch --help` stays fast

    from ds_recycle.launcher.hostwatch import Lease, NodeWatch
    from ds_recycle.launcher.nodes import OtherNodes
    from ds_recycle.launcher.supervisor import Supervisor

    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        job = build_job(args, args.master_port, cuda_devices)
        if args.dry_run:
            _print_dry_run(job, args)
            return 0, True
        store = _open_store(job, args)
    except (ValueError, OSError) as err:  # HostfileError is a ValueError
        print(f"ds-recycle launch: error: {err}", file=sys.stderr)
        return 2, True
    job = build_job(args, int(getattr(store, "port", None) or args.master_port or _DEFAULT_PORT), cuda_devices)
    _warn_if_node0_elsewhere(job)
    logger.info("store at %s; node %d of %d runs ranks %s of %d", job.store or f"{job.master_addr}:{job.master_port}",
                job.node_rank, len(job.layout.nodes), list(job.local_ranks), job.layout.world_size)
    sink = OutputSink(sys.stdout)
    if server is not None and cuda_devices:  # (the early check saw no NVIDIA device: it cannot be this)
        server.close()
        server = None
    workers = [Worker(spec, sink, server) for spec in worker_specs(job)]
    node0 = job.node_rank == 0
    remotes = _remote_workers(job, args, sink) if node0 and not args.no_ssh else []
    other_nodes = [k for k in range(len(job.layout.nodes)) if k != job.node_rank]
    several_on_etcd = job.store is not None and bool(other_nodes)
    others = None
    if (node0 and args.no_ssh and other_nodes) or several_on_etcd:  # wait for the others' ranks, report the job
        others = OtherNodes(store, job.layout, other_nodes, args.store_timeout)
    watch, lease, lease_store, rejoin = None, None, None, False
    if (node0 and not job.store_service and job.store is None) or several_on_etcd:
        # the store's host watches the other nodes; on etcd no launcher hosts it, so every one does (one declares
        # each loss)
        watch = NodeWatch(job.layout, job.node_timeout_s, other_nodes, me=str(job.node_rank),
                          restart_start_up=not job.policy.strict)
    if job.node_rank > 0 or job.store_service or several_on_etcd:
        lease = Lease(job.master_addr, job.master_port, job.node_rank, job.node_timeout_s, args.store_timeout,
                      store_spec=job.store)
        try:
            lease_store = lease.connect()
            rejoin = lease.beat_before(lease_store)
        except (RuntimeError, OSError) as err:
            print(f"ds-recycle launch: error: the store at {lease.where} went away: {err}", file=sys.stderr)
            return 2, True
    supervisor = Supervisor(job, store, workers, remotes, hosts_store=node0, others=others, watch=watch, lease=lease,
                            lease_store=lease_store, rejoin=rejoin)
    return supervisor.run(), supervisor.lease_ended


def _early_fork_server(args: argparse.Namespace) -> ForkServer | None:
    """The node's fork server (``--preload``), started first thing with the workers' common environment; None: none
    (off, not Linux, an NVIDIA device present, a dry run, or options that the job will refuse anyway)."""
    if args.preload == "off" or args.dry_run or not sys.platform.startswith("linux"):
        return None
    if _nvidia_present():
        if args.preload == "on":
            logger.warning("--preload on: not on a machine with CUDA devices (a parent that touched CUDA cannot fork "
                           "workers that use it); workers start as fresh processes")
        return None
    try:
        specs = worker_specs(build_job(args, args.master_port or _DEFAULT_PORT, cuda_devices=0))
    except (ValueError, OSError):  # reported with its reason once the job is built for real
        return None
    return ForkServer(specs[0].env, pdeathsig_argv) if specs else None


def _nvidia_present() -> bool:
    """An NVIDIA driver or device node is there (told without importing torch: CUDA may be usable)."""
    return os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/nvidiactl")
