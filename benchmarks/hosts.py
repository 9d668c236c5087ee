"""Whole hosts failing: time from a host's loss, or from its link's cut, to the first full iteration after it,
and throughput before and after, for ds_recycle and for vanilla DeepSpeed under DeepSpeed's own launcher.

    sudo PYTHONPATH=$PWD .venv/bin/python benchmarks/hosts.py --out benchmarks/results/hosts-$(date +%F).txt

Hosts are Linux network namespaces on a private bridge, each with its own network stack (``tests/nethosts.py``;
needs root); two workers a host, the tests' tiny GPT (2 stages, 2 pipelines on 2 hosts, 3 pipelines on 3 hosts).
Each scenario is one job:

* ``recycle host-loss``: every process of host 1 SIGKILLed at once (launcher and workers). On 3 hosts every
  stage keeps a replica: the job goes on without the host. On 2 hosts host 1 held the whole of stage 1: the
  job falls back to its checkpoint; host 1's launcher is started again at once (``--no_ssh --node_rank 1``)
  and node 0's ranks are restarted by their launcher (``--restart_failed_after 1``).
* ``recycle partition``: host 1's link is cut while its processes live, and put back once the store's node
  watch has declared the host lost (so the cut lasts the node timeout plus polling). Its launcher fences its
  workers; on 3 hosts the others go on, on 2 hosts the job falls back as above (once the link is back).
* ``etcd host-loss``, ``etcd partition``, ``etcd node0-loss``, ``etcd two-hosts-loss`` (3 hosts): the job's
  store on etcd (``--store etcd://...``), one etcd member per host; before a host is SIGKILLed its etcd member is
  made the leader (the worst case). ``node0-loss`` loses host 0 (node 0's launcher, its workers and the leader);
  ``two-hosts-loss`` loses hosts 1 and 2 at once: the survivor has no etcd quorum, fences its workers and leaves;
  reported: how long until node 0's launcher ended, and whether the latest checkpoint is whole.
  ``recycle two-hosts-loss`` is the same with node 0's TCP store (where host 0 holds only stage 0, the job
  falls back to its checkpoint and waits for the lost hosts' ranks: ``job_ended_after_s`` null).
* ``vanilla host-loss``: ``deepspeed --no_ssh --node_rank K`` per host, ``--vanilla`` (DeepSpeed's stock
  PipelineEngine), same checkpoint interval; after host 1's SIGKILL the job dies; as soon as every launcher has
  exited it is started again on every host with ``--resume``.
* ``vanilla partition``: the same job with host 1's link cut: nothing fails, nothing moves (gloo waits for its
  timeout, DeepSpeed's default 30 min); the benchmark reports how long it watched without progress.

Measured: ``to_first_full_iteration_s`` = wall clock from the SIGKILL (or the cut) to the end of the first
iteration after it that ran with the job's full batch (the reporter's metrics record: a re-routed iteration
for ds_recycle when it goes on, the first iteration after the resume otherwise); tokens/s = median over the 10
iterations before the event and the 10 after that first full iteration. ``--node_timeout`` 6 s for ds_recycle
(the fence comes after 3 s), a checkpoint every 10 iterations for all.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ds_recycle.events import HostLostEvent, RecoveredEvent, ResumedEvent, events_of  # noqa: E402
from tests.etcd_cluster import EtcdCluster  # noqa: E402  (the benchmark reuses the tests' hosts and job helper)
from tests.harness import tiny_config  # noqa: E402
from tests.hosts.cluster import PORT, HostJob  # noqa: E402
from tests.nethosts import NetHosts, namespaces_refused  # noqa: E402

NODE_TIMEOUT_S = 6.0
CKPT_EVERY = 10
KILL_AT = 25


def _median_rate(recs: Sequence[dict[str, Any]]) -> float | None:
    rates = [r["tokens_per_s"] for r in recs if r.get("tokens_per_s")]
    return round(statistics.median(rates), 1) if rates else None


def _after(recs: list[dict[str, Any]], t: float) -> list[dict[str, Any]]:
    return [r for r in recs if r["unix_time"] > t]


def _summary(name: str, hosts_n: int, recs: list[dict[str, Any]], event_t: float, first_full: dict[str, Any] | None,
             extra: dict[str, Any]) -> dict[str, Any]:
    before = [r for r in recs if r["unix_time"] <= event_t][-10:]
    after = [] if first_full is None else [r for r in recs if r["unix_time"] > first_full["unix_time"]][:10]
    return {"scenario": name, "hosts": hosts_n,
            "to_first_full_iteration_s": None if first_full is None else round(first_full["unix_time"] - event_t, 2),
            "first_full_iteration": None if first_full is None else first_full["iter"],
            "tokens_per_s_before": _median_rate(before), "tokens_per_s_after": _median_rate(after), **extra}


def _first_full_recycle(job: HostJob, event_t: float, timeout_s: float) -> dict[str, Any] | None:
    """The first record after ``event_t`` that carries a ``recovered`` event, or the first after a resume."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        recs = job.metrics()
        for r in _after(recs, event_t):
            if bool(events_of([r], RecoveredEvent)) or bool(events_of([r], ResumedEvent)):
                return r
        time.sleep(0.2)
    return None


def run_recycle(hosts_n: int, event: str, work: Path, steps: int, store: str = "tcp") -> dict[str, Any]:
    config = tiny_config(work, "cfg", 2, hosts_n)
    with NetHosts(hosts_n, work) as hosts:
        cluster = None
        launcher_args = ["--restart_failed_after", "1"]
        if store == "etcd":  # one etcd member per host: the job's store has no host it cannot lose
            (work / "etcd").mkdir()
            cluster = EtcdCluster(work / "etcd", hosts=hosts)
            launcher_args += ["--store", cluster.endpoints + "/bench"]
        try:
            job = HostJob(hosts, work, config, steps, slots=2, worker_hosts=list(range(hosts_n)),
                          node_timeout_s=NODE_TIMEOUT_S, launcher_args=launcher_args,
                          train_args=["--checkpoint-dir", str(work / "ckpt"), "--checkpoint-interval",
                                      str(CKPT_EVERY), "--resume"])
            job.start_all_no_ssh()
            job.wait_iteration(KILL_AT, 300)
            victim = 0 if event == "node0-loss" else 1
            if cluster is not None and event != "partition":
                cluster.move_leader(victim)  # the worst case: the lost host's etcd member leads
            event_t = time.time()
            before = job.metrics()  # a reporter restarted after a fallback starts its metrics file again
            extra: dict[str, Any] = {"store": store, "lost_host": victim}
            if event == "two-hosts-loss":
                return _two_hosts_lost(job, hosts, work, store, event_t, before)
            if event in ("host-loss", "node0-loss"):
                hosts.kill_host(victim)
                if hosts_n == 2:  # the whole of stage 1 is gone: host 1 comes back, the job resumes its checkpoint
                    hosts.revive(1)
                    if cluster is not None:
                        cluster.start(1)
                    job.start_node(1)
            else:
                hosts.cut(1)
                _wait_log(job, "host event host_lost", 60)  # in a launcher's log: the reporter may be on host 1
                extra["cut_s"] = round(time.time() - event_t, 2)
                hosts.heal(1)
            first = _first_full_recycle(job, event_t, 240)
            lost = events_of(before + job.metrics(), HostLostEvent)
            if lost:
                extra["host_lost_declared_after_s"] = round(lost[0].time_s - event_t, 2)
            recovered = job.events(RecoveredEvent)
            if recovered:
                extra["recovered_event"] = {k: getattr(recovered[0], k)
                                            for k in ("detection_s", "agreement_s", "regroup_s", "redo_s",
                                                      "committed_stages")}
            codes = job.finish(600)
            extra["exit_codes"] = codes
            recs = [r for r in before if r["unix_time"] <= event_t] + _after(job.metrics(), event_t)
            return _summary(f"{'etcd' if store == 'etcd' else 'recycle'} {event}", hosts_n, recs, event_t, first,
                            extra)
        finally:
            if cluster is not None:
                cluster.close()


def _two_hosts_lost(job: HostJob, hosts: NetHosts, work: Path, store: str, event_t: float,
                    before: list[dict[str, Any]]) -> dict[str, Any]:
    """Hosts 1 and 2 SIGKILLed together: how long until node 0's launcher has ended, and whether the latest
    checkpoint is whole (every stage's file there)."""
    hosts.kill_host(1)
    hosts.kill_host(2)
    try:
        code: int | None = job.wait("node0", 300)
        ended: float | None = round(time.time() - event_t, 2)
    except AssertionError:  # still running: waiting for the lost hosts' ranks to come back
        code, ended = None, None
    ckpt = work / "ckpt"
    latest = (ckpt / "latest").read_text().strip() if (ckpt / "latest").exists() else None
    whole = latest is not None and sorted(p.name for p in (ckpt / latest).iterdir()) == ["stage0.pt", "stage1.pt"]
    extra = {"store": store, "job_ended_after_s": ended, "node0_exit": code, "latest_checkpoint": latest,
             "latest_checkpoint_whole": whole}
    return _summary(f"{'etcd' if store == 'etcd' else 'recycle'} two-hosts-loss", 3, before, event_t, None, extra)


def _wait_log(job: HostJob, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(text in job.text(f"node{k}") for k in range(len(job.worker_hosts))):
        if time.monotonic() > deadline:
            raise SystemExit(f"{text!r} not in a launcher's log within {timeout_s} s: see {job.folder}")
        time.sleep(0.1)


def _deepspeed_nodes(hosts: NetHosts, work: Path, config: Path, steps: int, life: int,
                     hosts_n: int) -> list[subprocess.Popen[str]]:
    hostfile = hosts.hostfile(2, name="ds-hostfile")
    deepspeed = str(Path(sys.executable).parent / "deepspeed")
    env = hosts.env({"PYTHONPATH": str(REPO), "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1",
                     "GLOO_SOCKET_IFNAME": "eth0"})  # the host name resolves to loopback in every namespace
    procs = []
    for k in range(hosts_n):
        log = open(work / f"vanilla-node{k}-life{life}.log", "w")  # noqa: SIM115
        argv = [deepspeed, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(k), "--master_addr",
                hosts.addrs[0], "--master_port", str(PORT), str(REPO / "launch" / "train.py"),
                "--deepspeed_config", str(config), "--steps", str(steps), "--vanilla",
                "--metrics", str(work / f"vanilla-metrics-{life}.jsonl"), "--checkpoint-dir", str(work / "ckpt"),
                "--checkpoint-interval", str(CKPT_EVERY), "--resume"]
        procs.append(hosts.run(k, argv, env=env, cwd=REPO, stdout=log))
        log.close()
    return procs


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def _wait_iteration(path: Path, iteration: int, timeout_s: float, after: float = 0.0) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for r in _records(path):
            if r["iter"] >= iteration and r["unix_time"] > after:
                return r
        time.sleep(0.2)
    return None


def run_vanilla(hosts_n: int, event: str, work: Path, steps: int, watch_s: float) -> dict[str, Any]:
    config = tiny_config(work, "cfg", 2, hosts_n)
    with NetHosts(hosts_n, work) as hosts:
        procs = _deepspeed_nodes(hosts, work, config, steps, 0, hosts_n)
        try:
            if _wait_iteration(work / "vanilla-metrics-0.jsonl", KILL_AT, 300) is None:
                raise SystemExit(f"vanilla never reached iteration {KILL_AT}: see {work}")
            event_t = time.time()
            extra: dict[str, Any] = {}
            if event == "partition":
                hosts.cut(1)
                before = len(_records(work / "vanilla-metrics-0.jsonl"))
                time.sleep(watch_s)
                moved = len(_records(work / "vanilla-metrics-0.jsonl")) - before
                alive = sum(p.poll() is None for p in procs)
                extra.update(watched_s=watch_s, iterations_during_watch=moved, launchers_alive=alive)
                return _summary(f"vanilla {event}", hosts_n, _records(work / "vanilla-metrics-0.jsonl"), event_t,
                                None, extra)
            hosts.kill_host(1)
            for p in procs:
                try:
                    p.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    extra["hung_launchers"] = extra.get("hung_launchers", 0) + 1
                    p.kill()
            extra["job_down_after_s"] = round(time.time() - event_t, 2)
            hosts.revive(1)
            procs = _deepspeed_nodes(hosts, work, config, steps, 1, hosts_n)
            first = _wait_iteration(work / "vanilla-metrics-1.jsonl", 0, 300, after=event_t)
            _wait_iteration(work / "vanilla-metrics-1.jsonl", steps - 1, 600)
            recs = _records(work / "vanilla-metrics-0.jsonl") + _records(work / "vanilla-metrics-1.jsonl")
            if first is not None:
                extra["resumed_at_iteration"] = first["iter"]
            return _summary(f"vanilla {event}", hosts_n, recs, event_t, first, extra)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="results file (text; a .json with the same stem is written too)")
    p.add_argument("--hosts", default="2,3", help="host counts to run, e.g. 3")
    p.add_argument("--scenarios", default="recycle host-loss,recycle partition,vanilla host-loss,vanilla partition")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--watch", type=float, default=60.0, help="seconds vanilla's partition is watched")
    args = p.parse_args()
    reason = namespaces_refused()
    if reason is not None:
        raise SystemExit(f"benchmarks/hosts.py needs network namespaces: {reason}")
    results = []
    load_start = os.getloadavg()
    for hosts_n in (int(h) for h in args.hosts.split(",")):
        for scenario in args.scenarios.split(","):
            system, event = scenario.split()
            work = Path(tempfile.mkdtemp(prefix=f"hosts-{system}-{event}-{hosts_n}-"))
            t0 = time.time()
            if system in ("recycle", "etcd"):
                res = run_recycle(hosts_n, event, work, args.steps, store="etcd" if system == "etcd" else "tcp")
            else:
                res = run_vanilla(hosts_n, event, work, args.steps, args.watch)
            res["wall_s"] = round(time.time() - t0, 1)
            res["workdir"] = str(work)
            results.append(res)
            sys.stderr.write(json.dumps(res) + "\n")
    lines = [f"benchmarks/hosts.py, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"machine: {platform.node()} {platform.machine()}, {len(os.sched_getaffinity(0))} cores "
             f"(shared), Linux {platform.release()}, Python {platform.python_version()}",
             f"command: sudo PYTHONPATH=$PWD .venv/bin/python benchmarks/hosts.py --hosts {args.hosts} "
             f"--steps {args.steps} --scenarios '{args.scenarios}'",
             f"load average (1 min) at start {load_start[0]:.1f}, at end {os.getloadavg()[0]:.1f}",
             f"node timeout {NODE_TIMEOUT_S} s, checkpoint every {CKPT_EVERY} iterations, event at iteration "
             f"{KILL_AT}, 2 workers a host, tiny GPT (tests/harness.py tiny_config), 2 stages", ""]
    header = f"{'scenario':<20}{'hosts':>6}{'to 1st full it (s)':>20}{'tok/s before':>14}{'tok/s after':>13}"
    lines.append(header)
    for r in results:
        lines.append(f"{r['scenario']:<20}{r['hosts']:>6}{str(r['to_first_full_iteration_s']):>20}"
                     f"{str(r['tokens_per_s_before']):>14}{str(r['tokens_per_s_after']):>13}")
    lines += ["", "details:"] + [json.dumps(r) for r in results]
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
