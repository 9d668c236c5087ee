"""``ds-recycle launch``: start a job's workers so that they survive each other's failures.

The `deepspeed` launcher and ``torchrun`` kill every worker when one dies, and with the `deepspeed` launcher
rank 0 hosts the rendezvous store, so the store dies with it. This launcher keeps the `deepspeed` command line
but hosts the store itself (node 0's launcher process), never signals a survivor because another worker died,
reports every exit, and exits non-zero only if the job as a whole failed::

    ds-recycle launch --num_accelerators 4 train.py --deepspeed_config cfg.json
    python -m ds_recycle launch --num_gpus 4 --master_port 0 --log_ranks 0 train.py
    ds-recycle restart --master_addr 127.0.0.1 --master_port 29500 2      # rank 2 was lost: start it again now

Files: :mod:`.cli` (options), :mod:`.hosts` (hostfile, ``--include``/``--exclude``), :mod:`.job` (command
line and environment of each rank), :mod:`.worker` (one process), :mod:`.policy` (exit rules, as functions),
:mod:`.supervisor` (the loop), :mod:`.store` (the store and its keys), :mod:`.remote` (ssh commands),
:mod:`.restart_requests` (the rule for restarts on command) and :mod:`.restart_cmd` (``ds-recycle restart``).

**Environment of each worker.** The env:// contract (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, plus `deepspeed`'s ``LOCAL_SIZE``, ``CROSS_RANK``,
``CROSS_SIZE`` and ``CUDA_VISIBLE_DEVICES`` = the node's slots, mapped through the launcher's own
``CUDA_VISIBLE_DEVICES`` when that lists device numbers), and ``TORCHELASTIC_USE_AGENT_STORE=True``:
in torch's ``rendezvous.py`` that is the only switch that makes every rank, rank 0 included, connect to the
existing store as a client instead of rank 0 creating one. No key prefix is needed: ``init_process_group``
puts its keys under ``default_pg``. (A restarted rank that wants a fresh world must build its groups under a
new prefix: the old world's keys are still there.) ``TORCHELASTIC_RESTART_COUNT`` and
``DS_RECYCLE_RESTART_COUNT`` hold the rank's restart count; ``DS_RECYCLE_LAUNCHER=1`` and
``DS_RECYCLE_STORE=host:port`` tell the worker that the store outlives it; ``DS_RECYCLE_LOST_EXIT_CODE=75``
is the exit code that declares the worker lost rather than failed. ``OMP_NUM_THREADS``/``MKL_NUM_THREADS``
are set to ``--threads_per_worker`` (default 1 on a machine without CUDA; left alone with CUDA) unless
``OMP_NUM_THREADS`` is already set, and
``DS_ACCELERATOR=cpu`` when no CUDA device is visible and it is not set. ``--local_rank=N`` is appended to
the script's arguments, as `deepspeed` does, unless ``--no_local_rank``; ``torchrun``-style scripts read
``LOCAL_RANK`` instead. The same script therefore runs, without failure survival, under `deepspeed` and
``torchrun`` too.

**Store keys** (written by the launchers; see :mod:`.store`): ``ds_recycle/exit/<rank>`` = the return code
of the rank's exit (negative: killed by that signal; deleted when the rank is restarted); ``ds_recycle/exits`` = a counter of exits (the
launcher sees a death first and writes both within milliseconds, so a worker can poll the counter);
``ds_recycle/restarted/<rank>`` = how many times the rank was restarted; ``ds_recycle/stop`` = why the job is
being stopped; ``ds_recycle/world_size``; ``ds_recycle/restart_request/<rank>``, the counter
``ds_recycle/restart_requests`` and ``ds_recycle/restart_result/<rank>`` carry restarts on command.

**Exit rules** (:mod:`.policy`): a signal death or exit code 75 is a tolerated loss; another non-zero code
fails the job and the others are stopped after ``--error_grace`` seconds; ``--strict`` stops everything on
any death, as `deepspeed` and ``torchrun`` do. SIGINT/SIGTERM to the launcher are forwarded to every worker,
which gets ``--kill_grace`` seconds before SIGKILL; a SIGKILLed launcher takes its workers with it on Linux
(``PR_SET_PDEATHSIG``); no process is left behind.

**Restart on command.** Without ``--restart_failed_after``, a lost rank stays down until someone asks for
it; the job goes on without it, and still ends when its last running worker ends (it never waits for a
command)::

    ds-recycle restart --master_addr ADDR --master_port PORT RANK [RANK ...] [--timeout 30]

``ADDR:PORT`` is the job's store (the launcher logs ``store at ADDR:PORT``). The command writes
``ds_recycle/restart_request/<rank>`` and bumps ``ds_recycle/restart_requests``; the launcher that runs the
rank (node 0's, or a remote node's for its own ranks) sees it at its next store poll (0.25 s) and restarts the
rank at once, through the same path as a timed restart (``ds_recycle/restarted/<rank>`` written, the exit key
deleted, ``DS_RECYCLE_RESTART_COUNT`` = the new count), iff the rank was *lost*, no timed restart of it is
due, the job is not stopping, and ``--max_restarts`` (shared by timed and commanded restarts) allows it.
Otherwise it refuses: rank running, finished, failed with an error, out of restarts, restart already due,
job stopping. Either way it logs the answer, writes it to ``ds_recycle/restart_result/<rank>`` and deletes
the request; the command prints it and exits 0 iff every rank was restarted (1: refused or no answer within
``--timeout``; 2: bad input, e.g. a negative rank, a rank outside the job, no job's store at that address).
A node other than 0 whose workers have all exited stays up while one of its ranks could still be restarted
and some rank of the job runs elsewhere, so that it can take the command; node 0 already waits for every rank.

**Several hosts** (``--hostfile``, ``--include``/``--exclude``, ``--num_nodes``): node 0 is the first host of
the layout and must be the host where ``ds-recycle launch`` is run; it hosts the store and starts, for every
other node, ``ssh HOST 'cd CWD && env VARS python -u -m ds_recycle launch --node_rank K --world_info ...'``
(:mod:`.remote`). With ``--no_ssh`` it starts nothing: the user (or a scheduler) runs ``ds-recycle launch
--no_ssh --node_rank K`` with the same hostfile and a fixed ``--master_port`` on each node, and node 0 waits
until every rank of every node has an exit key (:mod:`.nodes`). Remote launchers connect to the store,
announce themselves (``ds_recycle/node/<k>``), run their ranks, record their exits and obey
``ds_recycle/stop``; an error on any node stops every node after the grace. Node 0 computes the job's status
from every rank's exit key.

What is tested: all of the above on one machine with two launchers as two "nodes" (a hostfile naming
``localhost`` and ``127.0.0.1``): with ``--no_ssh``, cross-launcher rendezvous, remote exit records, node 0's
job status, an error on node 1 stopping node 0, node 1 stopping its workers when node 0 is SIGKILLed, node 1
restarting its own rank on command; and
node 0 starting node 1 through its generated ssh command line, run by a stand-in ``ssh`` that executes the
command locally. And across separate network stacks (``tests/hosts/``: 2-4 hosts as Linux network
namespaces on a private bridge, each with its own sshd): real ssh from node 0, ``--no_ssh`` with one launcher per
host, a whole host SIGKILLed, a link cut and put back, node 0's host lost under a ``ds-recycle store`` service,
node 0's launcher SIGKILLed with the default store. Not run: two physical machines (the namespaces share the CPU,
the clock and the file system).

**Hosts as units of failure** (:mod:`.hostwatch`): every launcher that does not host the store beats in it; the
store's host declares a node silent for ``--node_timeout`` lost (its ranks get exit code 75); a launcher cut off
from the store SIGKILLs its own workers after half that time, and restarts them once it is back and declared
lost. A request (``ds-recycle restart``) for ranks of a node whose host was lost is answered by node 0 when it
started that node over ssh: it starts the node's launcher again, which restarts the node's ranks.
``ds-recycle store`` (:mod:`.store_cmd`) hosts the store on a host with no workers, so that node 0 can be
lost too (``--store_service`` on every launcher). :mod:`.netif` picks gloo's interface when the host name
resolves to loopback.
"""
from __future__ import annotations

from ds_recycle.launcher.hosts import HostfileError, Layout, NodeSlots, resolve_layout
from ds_recycle.launcher.job import JobSpec, Program, worker_env, worker_specs
from ds_recycle.launcher.policy import Action, ExitPolicy, decide, job_status
from ds_recycle.launcher.worker import LOST_EXIT_CODE, ExitKind, Worker, WorkerExit, WorkerSpec

__all__ = [
    "Action", "ExitKind", "ExitPolicy", "HostfileError", "JobSpec", "LOST_EXIT_CODE", "Layout", "NodeSlots",
    "Program", "Worker", "WorkerExit", "WorkerSpec", "decide", "job_status", "resolve_layout", "worker_env",
    "worker_specs",
]
