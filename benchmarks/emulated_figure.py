"""The paper's figure on emulated accelerators: throughput against failures, ds_recycle vs vanilla DeepSpeed.

    .venv/bin/python benchmarks/emulated_figure.py --feed-back --out benchmarks/results/emulated-$(date +%F).txt
                              # the figure: 4x4 and 8x4, M = S and 2S, every case (48 jobs, about 2 h)
    .venv/bin/python benchmarks/emulated_figure.py --shapes 8x4 --microbatches 8 --cases core
    .venv/bin/python benchmarks/emulated_figure.py --report-from A.jsonl B.jsonl --out T.txt   # no runs
    .venv/bin/python benchmarks/emulated_figure.py --costs-file runs/emulated/fed-back-4x4.json --shapes 4x4 ...

Every job is the user-style script ``benchmarks/emulated/train.py`` on the emulated GPT (``benchmarks/emulated/``:
layers whose F, B and W *sleep* the time of a cost profile of GPT-3 2.7B on A100 nodes, scaled so the slowest
forward is ``--f-ms``), one process a worker on this machine:

- ``vanilla``: the script unchanged under DeepSpeed's launcher (``deepspeed``): DeepSpeed's 1F1B;
- ``zb-h1``, ``adaptive``: the ds_recycle variant (the documented two-line change) under ``ds-recycle launch``
  with that schedule, failure-free;
- ``absent ...``: workers absent from the start (``recycle.assume_failed``): 1, 2 and 3 failures, in one stage
  and in different stages;
- ``kill ...``: workers killed mid-run, by ``recycle.faults`` (deterministic, inside the worker) or by an
  outside SIGKILL once the reporter printed a given step; the time per iteration is taken after recovery and
  the recovery time is the engine's ``failure_to_full_iteration_s`` (kill to the first full iteration after it).

Cases run in the order given, round after round (``--rounds``), so load changes hit every case alike. For each:
the measured time per iteration (median over the steps after ``--warmup``), the planner's prediction for the
same plan (the plan the runtime made, from the same costs file), the lower bound of the failure set, the
throughput kept against ds_recycle's failure-free (adaptive) run, the runtime's CPU time per operation
(all its ranks' process CPU time over the timed steps, over the 3 S D M compute operations of an iteration),
the whole machine's CPU use and load average during the timed steps, and the recovery time of the kills.

Vanilla DeepSpeed under the same failures is *modelled*, not run (its job dies with any worker): each failure
costs a restart (the measured start-up of the vanilla job of this shape: launch to its first finished
iteration) plus the work lost since the last checkpoint (half of ``--checkpoint-interval`` iterations on
average), and with no spare machines it restarts on the pipelines that still have every worker, so its
throughput is ``(D - pipelines hit) / D`` of its failure-free one, over a window of ``--window`` iterations
after the failures. The plot (``.png`` next to ``--out``) shows throughput (samples/s) against the number of
failures, one panel per shape and M.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.emulated.profiles import PROFILES, profile, write_profile  # noqa: E402
from ds_recycle.events import RecoveredEvent, parse_event  # noqa: E402
from ds_recycle.plan import CostModel, lower_bound, make_plan, simulate  # noqa: E402
from ds_recycle.tools.procs import descendants, rss_bytes, scan_proc  # noqa: E402
from tests.byom.harness import Job, free_port, recycle_variant  # noqa: E402

SCRIPT = REPO / "benchmarks" / "emulated" / "train.py"
VENV_BIN = Path(sys.executable).parent
_STEP = re.compile(r"step (\d+) loss (\S+) t ([0-9.]+)")
_CPU = re.compile(r"cpu rank (\d+) s ([0-9.]+) iterations (\d+)")
_EVENT = re.compile(r'^(?:\[rank \d+\] )?event (\{".*\})\s*$', re.MULTILINE)

Worker = tuple[int, int]


@dataclass(frozen=True)
class Case:
    """One job: engine, schedule, and the failures (absent from the start, or killed mid-run)."""

    name: str
    engine: str  # "vanilla" or "recycle"
    schedule: str = "adaptive"
    absent: tuple[Worker, ...] = ()
    faults: tuple[tuple[Worker, int, str], ...] = ()
    """Kills by ``recycle.faults``: (worker, iteration, phase)."""
    sigkill: tuple[tuple[Worker, int], ...] = ()
    """Outside SIGKILLs: (worker, after the reporter printed this step)."""
    launcher: str = "ds-recycle"
    """``ds-recycle`` (failure handling on) or ``torchrun`` (the ds_recycle engine without it)."""
    slow: tuple[tuple[Worker, int, float], ...] = ()
    """Slow workers (fail-slow): (worker, from this step on, factor)."""
    jitter: float = 0.0
    """Timing noise: each emulated op time scaled by a factor from [1 - jitter, 1 + jitter]."""
    fail_slow: bool = True
    """ds_recycle's detection of slow workers and re-planning around them (``recycle.fail_slow.enabled``)."""
    model_args: tuple[str, ...] = ()
    """The emulated model's arguments to the script (default: ``--costs`` with the run's profile)."""
    recycle_extra: str = ""
    """JSON object merged into the config's ``recycle`` section."""
    launcher_args: tuple[str, ...] = ()
    """Extra arguments to ``ds-recycle launch``."""

    @property
    def failed(self) -> tuple[Worker, ...]:
        return self.absent + tuple(w for w, _, _ in self.faults) + tuple(w for w, _ in self.sigkill)

    @property
    def killed(self) -> bool:
        return bool(self.faults or self.sigkill)


def cases_for(stages: int, pipelines: int, which: str, kill_at: int) -> list[Case]:
    """The figure's cases for an ``S x D`` job (failures avoid the first stage, which also loads data)."""
    s1, s2, s3 = 1 % stages, 2 % stages, 3 % stages
    out = [Case("vanilla 1F1B", "vanilla", "1f1b"), Case("ds_recycle ZB-H1", "recycle", "zb-h1"),
           Case("ds_recycle adaptive", "recycle"),
           Case("ds_recycle ZB-H1, torchrun", "recycle", "zb-h1", launcher="torchrun")]
    absent = [("1 absent", ((0, s2),)),
              ("2 absent, same stage", ((0, s1), (1, s1))),
              ("2 absent, 2 stages", ((0, s1), (1, s2))),
              ("3 absent, same stage", ((0, s1), (1, s1), (2, s1))),
              ("3 absent, 3 stages", ((0, s1), (1, s2), (2, s3)))]
    kills = [Case("1 killed (faults)", "recycle", faults=(((0, s2), kill_at, "backward-input"),)),
             Case("1 killed (SIGKILL)", "recycle", sigkill=(((1, s1), kill_at - 1),)),
             Case("2 killed (faults), 2 stages", "recycle",
                  faults=(((0, s1), kill_at, "forward"), ((1, s2), kill_at, "backward-weight")))]
    if which == "core":
        absent = [absent[0], absent[2], absent[4]]
        kills = kills[:2]
    out += [Case(name, "recycle", absent=tuple(a)) for name, a in absent if len(a) < pipelines]
    return out + (kills if which != "failure-free" else [])


# ---------------------------------------------------------------------------------------------- sampling
class Sampler:
    """Whole-machine CPU use (``/proc/stat``), load average and the job's total RSS, every ``period`` s."""

    def __init__(self, root_pid: int, period: float = 0.5) -> None:
        self.root, self.period = root_pid, period
        self.samples: list[tuple[float, float, float, float]] = []  # (time, busy jiffies, total jiffies, load1)
        self.peak_rss = 0
        self.ticks: dict[int, int] = {}
        self.tick_samples: list[tuple[float, int]] = []
        """(time, CPU clock ticks used so far by the launcher and every process under it)."""
        self.available_at_start = self._available()
        self.least_available = self.available_at_start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _jiffies() -> tuple[float, float]:
        fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
        return sum(fields) - idle, sum(fields)

    @staticmethod
    def _available() -> int:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
        return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            busy, total = self._jiffies()
            self.samples.append((time.time(), busy, total, os.getloadavg()[0]))
            rss = 0
            for pid in [self.root, *descendants(scan_proc(), self.root)]:
                try:
                    rss += rss_bytes(Path(f"/proc/{pid}/status").read_text())
                    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
                    self.ticks[pid] = max(self.ticks.get(pid, 0), int(fields[11]) + int(fields[12]))
                except (OSError, ValueError, IndexError):
                    pass
            self.tick_samples.append((time.time(), sum(self.ticks.values())))
            self.peak_rss = max(self.peak_rss, rss)
            self.least_available = min(self.least_available, self._available())
            self._stop.wait(self.period)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def window(self, t0: float, t1: float) -> tuple[float, float]:
        """(fraction of all cores busy, mean load average) between wall-clock times ``t0`` and ``t1``."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return float("nan"), float("nan")
        (_, b0, n0, _), (_, b1, n1, _) = inside[0], inside[-1]
        return (b1 - b0) / max(n1 - n0, 1e-9), statistics.mean(s[3] for s in inside)

    def job_share(self, t0: float, t1: float) -> float:
        """CPU of the launcher and all its processes between ``t0`` and ``t1``, as a fraction of all cores."""
        inside = [s for s in self.tick_samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return float("nan")
        (a, c0), (b, c1) = inside[0], inside[-1]
        return (c1 - c0) / os.sysconf("SC_CLK_TCK") / max(b - a, 1e-9) / (os.cpu_count() or 1)


# ---------------------------------------------------------------------------------------------- one job
@dataclass
class Result:
    case: Case
    stages: int
    pipelines: int
    microbatches: int
    times: list[float] = field(default_factory=list)
    """Seconds per iteration over the timed steps."""
    startup_s: float = float("nan")
    """Launch to the first finished iteration."""
    cpu_s: float = 0.0
    """All ranks' process CPU seconds over their timed steps."""
    cpu_iterations: int = 0
    machine_busy: float = float("nan")
    load: float = float("nan")
    recovery_s: float | None = None
    peak_rss_gb: float = 0.0
    """Sum of the job's processes' RSS (shared pages counted in each)."""
    mem_gb: float = 0.0
    """Drop of the machine's MemAvailable during the job (other tenants' use shows too)."""
    job_share: float = float("nan")
    """CPU of the launcher (its store) and the workers over the timed steps, a fraction of all cores."""
    ok: bool = True
    note: str = ""
    stamps: dict[int, float] = field(default_factory=dict)
    """Wall clock at the end of each step, by step."""
    events: list[Any] = field(default_factory=list)
    """ds_recycle's events, as the reporter printed them."""

    @property
    def per_iteration(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")

    def job_cpu_share(self) -> float:
        """The job's CPU use over the timed steps, as a fraction of all the machine's cores."""
        if not self.times or not self.cpu_iterations:
            return float("nan")
        return self.cpu_s / self.cpu_iterations / self.per_iteration / (os.cpu_count() or 1)

    def cpu_ms_per_op(self) -> float:
        ops = 3 * self.stages * self.pipelines * self.microbatches
        return 1e3 * self.cpu_s / max(self.cpu_iterations, 1) / ops


def _configs(work: Path, case: Case, stages: int, pipelines: int, m: int, costs_file: Path) -> Path:
    base: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": m,
                            "gradient_clipping": 1.0, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False,
                            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
                            "zero_optimization": {"stage": 0}}
    if case.engine == "recycle":
        # heartbeat_stale_s 60: on a machine saturated by other jobs a worker starved for over 10 s while the engine
        # is built is fenced as hung, which ends the job (a failure before the first train_batch); kills are found
        # through the launcher's exit reports either way.
        base["recycle"] = {"stages": stages, "pipelines": pipelines, "schedule": case.schedule,
                           "costs_file": str(costs_file), "heartbeat_stale_s": 60.0,
                           "assume_failed": [list(w) for w in case.absent],
                           "faults": [{"worker": list(w), "iteration": it, "phase": ph} for w, it, ph in case.faults],
                           "fail_slow": {"enabled": case.fail_slow}}
        if case.recycle_extra:
            base["recycle"].update(json.loads(case.recycle_extra))
    path = work / "ds.json"
    path.write_text(json.dumps(base, indent=1))
    return path


def run_case(case: Case, stages: int, pipelines: int, m: int, steps: int, warmup: int, profile_file: Path,
             costs_file: Path, work: Path) -> Result:
    work.mkdir(parents=True, exist_ok=True)
    config = _configs(work, case, stages, pipelines, m, costs_file)
    nproc = stages * pipelines - len(case.absent)
    args = [str(SCRIPT if case.engine == "vanilla" else work / "train.py"), "--deepspeed_config", str(config),
            *(case.model_args or ("--costs", str(profile_file))), "--stages", str(stages), "--steps", str(steps),
            "--warmup", str(warmup),
            *(f"--slow={d}:{s}@{at}*{factor}" for (d, s), at, factor in case.slow),
            *([f"--jitter={case.jitter}"] if case.jitter else [])]
    if case.engine == "vanilla":
        cmd = [str(VENV_BIN / "deepspeed"), "--num_accelerators", str(nproc), "--master_port", str(free_port()),
               *args]
    elif case.launcher == "torchrun":
        (work / "train.py").write_text(recycle_variant(SCRIPT.read_text()))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]
    else:
        (work / "train.py").write_text(recycle_variant(SCRIPT.read_text()))
        cmd = [sys.executable, "-m", "ds_recycle", "launch", "--num_accelerators", str(nproc), "--master_port", "0",
               *case.launcher_args, *args]
    res = Result(case, stages, pipelines, m)
    started = time.time()
    job = Job(cmd, work, work / "unused.pt", [REPO])
    sampler = Sampler(job.proc.pid)
    try:
        for (d, s), after in case.sigkill:
            job.wait_for(rf"step {after} loss", timeout=900)
            job.kill_rank(s * pipelines + d, signal.SIGKILL)
        job.proc.wait(timeout=max(60.0, 900 - (time.time() - started)))
    except (AssertionError, subprocess.TimeoutExpired) as e:
        res.ok, res.note = False, str(e).splitlines()[0][:200]
    finally:
        job.close()
        sampler.stop()
    log = job.log
    (work / "log.txt").write_text(log)
    stamps: dict[int, float] = {}
    for step, _, t in _STEP.findall(log):
        stamps.setdefault(int(step), float(t))
    if job.proc.returncode != 0 or len(stamps) < steps:
        res.ok = False
        res.note = res.note or f"exit {job.proc.returncode}, {len(stamps)} of {steps} steps"
    for _rank, cpu, its in _CPU.findall(log):
        res.cpu_s += float(cpu)
        res.cpu_iterations = max(res.cpu_iterations, int(its))
    events = [parse_event(json.loads(e)) for e in _EVENT.findall(log)]
    res.stamps, res.events = stamps, events
    recovered = [e for e in events if isinstance(e, RecoveredEvent)]
    if recovered:
        res.recovery_s = max(e.failure_to_full_iteration_s for e in recovered)
    first_timed = warmup
    if case.killed:  # time the steps after the last kill's iteration and the one after it
        last = max([it for _, it, _ in case.faults] + [after + 1 for _, after in case.sigkill])
        first_timed = max(warmup, last + 2)
    if case.slow:  # time the steps from the first slow one on
        first_timed = max(first_timed, *(at for _, at, _ in case.slow))
    order = sorted(stamps)
    if order:
        res.startup_s = stamps[order[0]] - started
    res.times = [stamps[b] - stamps[a] for a, b in zip(order, order[1:]) if a >= first_timed - 1 and b in stamps]
    if len(order) > first_timed:
        t0, t1 = stamps[max(first_timed - 1, order[0])], stamps[order[-1]]
        res.machine_busy, res.load = sampler.window(t0, t1)
        res.job_share = sampler.job_share(t0, t1)
    res.peak_rss_gb = sampler.peak_rss / 2 ** 30
    res.mem_gb = (sampler.available_at_start - sampler.least_available) / 2 ** 30
    return res


def result_json(r: Result) -> dict[str, Any]:
    c = r.case
    return {"stages": r.stages, "pipelines": r.pipelines, "microbatches": r.microbatches,
            "case": {"name": c.name, "engine": c.engine, "schedule": c.schedule, "absent": c.absent,
                     "faults": c.faults, "sigkill": c.sigkill, "launcher": c.launcher},
            "ok": r.ok, "times": r.times, "startup_s": r.startup_s, "cpu_s": r.cpu_s,
            "cpu_iterations": r.cpu_iterations, "machine_busy": r.machine_busy, "load": r.load,
            "recovery_s": r.recovery_s, "peak_rss_gb": r.peak_rss_gb, "mem_gb": r.mem_gb, "note": r.note,
            "job_share": r.job_share}


def result_from_json(obj: dict[str, Any]) -> Result:
    c = obj["case"]
    case = Case(c["name"], c["engine"], c["schedule"], tuple(tuple(w) for w in c["absent"]),  # type: ignore[misc]
                tuple((tuple(w), it, ph) for w, it, ph in c["faults"]),  # type: ignore[misc]
                tuple((tuple(w), after) for w, after in c["sigkill"]), c["launcher"])  # type: ignore[misc]
    keys = ("times", "startup_s", "cpu_s", "cpu_iterations", "machine_busy", "load", "recovery_s", "peak_rss_gb",
            "mem_gb", "ok", "note")
    out = Result(case, obj["stages"], obj["pipelines"], obj["microbatches"], **{k: obj[k] for k in keys})
    out.job_share = obj.get("job_share", float("nan"))
    return out


# ---------------------------------------------------------------------------------------------- the planner
def predict(case: Case, stages: int, pipelines: int, m: int, costs: CostModel,
            fed: CostModel | None = None) -> tuple[float, float, float]:
    """(time per iteration of the case's plan, that plan's time under ``fed``, lower bound), in ms.

    The plan is the one the runtime makes (``make_plan`` with the runtime's costs, one iteration); ``fed``
    re-times the same orders under the fed-back costs (:func:`ds_recycle.plan.simulate`).
    """
    schedule = case.schedule if not case.failed else "adaptive"
    plan = make_plan(stages, pipelines, m, costs, case.failed, iterations=1, schedule=schedule)
    again = float("nan")
    if fed is not None:
        again = simulate(plan.workers, fed, optimizer=plan.optimizer, fused_backward=schedule == "1f1b").makespan
    return plan.time_per_iteration, again, lower_bound(stages, pipelines, m, costs, case.failed)


def fed_back(profile_costs: dict[str, Any], per_op_ms: float, comm_ms: float, o_ms: float) -> dict[str, Any]:
    """The profile with the runtime's measured per-operation overhead added to F, B, W, and measured comm and O."""
    out = dict(profile_costs)
    for kind in ("F", "B", "W"):
        out[kind] = [round(v + per_op_ms, 3) for v in profile_costs[kind]]
    out["O"] = [round(o_ms, 3)] * len(profile_costs["F"])
    out["comm"] = round(comm_ms, 3)
    out["source"] = (f"{profile_costs.get('source', '')}; fed back: + {per_op_ms:.2f} ms measured runtime CPU per "
                     f"F/B/W, comm {comm_ms:.3f} ms measured p2p, O {o_ms:.2f} ms")
    return out


# ---------------------------------------------------------------------------------------------- report
def vanilla_restart_model(ff_vanilla_s: float, startup_s: float, failed: tuple[Worker, ...], pipelines: int,
                          checkpoint_interval: int, window: int) -> float:
    """Modelled seconds per iteration of vanilla DeepSpeed restarting from checkpoints (module docstring)."""
    hit = len({d for d, _ in failed})
    if hit >= pipelines:
        return float("inf")
    steady = ff_vanilla_s * pipelines / (pipelines - hit)
    lost = len(failed) * (startup_s + 0.5 * checkpoint_interval * ff_vanilla_s)
    return (window * steady + lost) / window


def report(results: list[Result], args: argparse.Namespace, costs_by_shape: dict[tuple[int, int], CostModel],
           lines: list[str], comm_ms: float) -> None:
    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    groups: dict[tuple[int, int, int], list[Result]] = {}
    for r in results:
        groups.setdefault((r.stages, r.pipelines, r.microbatches), []).append(r)
    for (s, d, m), rs in groups.items():
        costs = costs_by_shape[(s, d)]
        by_name: dict[str, list[Result]] = {}
        for r in rs:
            by_name.setdefault(r.case.name, []).append(r)

        def med(name: str, by_name: dict[str, list[Result]] = by_name) -> float:
            vals = [t for r in by_name.get(name, []) for t in r.times]
            return statistics.median(vals) if vals else float("nan")

        ff = med("ds_recycle adaptive")

        def per_op(engine: str, rs: list[Result] = rs) -> float:
            vals = [r.cpu_ms_per_op() for r in rs if r.ok and r.case.engine == engine and not r.case.failed
                    and r.case.launcher == "ds-recycle"]
            return statistics.median(vals) if vals else 0.0

        fed = {e: CostModel.from_json(fed_back(costs.to_json(), per_op(e), comm_ms, 0.0)) for e in ("vanilla", "recycle")}
        say(f"\n{s} stages x {d} pipelines, M = {m} micro-batches of 1 sample ({s * d} workers; times in s; "
            "emulated accelerators)")
        say(f"fed-back costs: + measured CPU per op (vanilla {per_op('vanilla'):.2f} ms, ds_recycle "
            f"{per_op('recycle'):.2f} ms) on each F, B, W; comm {comm_ms:.3f} ms (gloo ping-pong)")
        say(f"{'case':<30}{'ok':>4}{'s/iter':>8}{'plan':>8}{'meas/pl':>8}{'plan+fb':>8}{'meas/fb':>8}{'bound':>8}"
            f"{'kept':>7}{'samp/s':>8}{'cpu ms/op':>10}{'%core/w':>8}{'job cpu':>8}{'+launch':>8}{'busy':>6}"
            f"{'load':>6}{'recov s':>8}{'RSS GB':>7}{'mem GB':>7}")
        for name, group in by_name.items():
            case = group[0].case
            t = med(name)
            plan_ms, fed_ms, bound_ms = predict(case, s, d, m, costs, fed[case.engine])
            plan_t, fed_t, bound_t = plan_ms / 1e3, fed_ms / 1e3, bound_ms / 1e3
            cpu = statistics.mean(r.cpu_ms_per_op() for r in group)
            job_cpu = statistics.mean(r.job_cpu_share() for r in group)
            per_worker = job_cpu * (os.cpu_count() or 1) / (s * d - len(case.absent))
            with_launcher = statistics.mean(r.job_share for r in group)
            busy = statistics.mean(r.machine_busy for r in group)
            load = statistics.mean(r.load for r in group)
            rec = [r.recovery_s for r in group if r.recovery_s is not None]
            ok = all(r.ok for r in group)
            star = "*" if case.killed else " "  # CPU counted from the warm-up on: the recovery is in it
            say(f"{name:<30}{'yes' if ok else 'NO':>4}{t:>8.3f}{plan_t:>8.3f}{t / plan_t:>8.3f}{fed_t:>8.3f}"
                f"{t / fed_t:>8.3f}{bound_t:>8.3f}{ff / t:>7.3f}{d * m / t:>8.2f}{cpu:>9.2f}{star}"
                f"{100 * per_worker:>6.1f}%{star}{100 * job_cpu:>6.0f}%{star}"
                f"{100 * with_launcher:>7.0f}%{100 * busy:>5.0f}%{load:>6.1f}"
                f"{(f'{max(rec):.2f}' if rec else '-'):>8}{max(r.peak_rss_gb for r in group):>7.2f}"
                f"{max(r.mem_gb for r in group):>7.2f}")
            for r in group:
                if not r.ok:
                    say(f"    failed run: {r.note}")
        if any(r.case.killed for r in rs):
            say("  *: killed mid-run: the workers' CPU is counted from the warm-up on, so it includes the recovery "
                "(and job cpu divides it by the time per iteration after it); +launch is sampled over the timed steps")
        van, zb = med("vanilla 1F1B"), med("ds_recycle ZB-H1")
        ad = ff
        pv = predict(Case("v", "vanilla", "1f1b"), s, d, m, costs, fed["vanilla"])
        pz = predict(Case("z", "recycle", "zb-h1"), s, d, m, costs, fed["recycle"])
        pa = predict(Case("a", "recycle"), s, d, m, costs, fed["recycle"])
        for label, meas, plan_pair in (("ZB-H1", zb, pz), ("adaptive", ad, pa)):
            say(f"failure-free ds_recycle {label} / vanilla: measured {meas / van:.3f}, plan {plan_pair[0] / pv[0]:.3f}"
                f" (fed-back costs {plan_pair[1] / pv[1]:.3f}); target: at most the plan's + 0.02")
        starts = [r.startup_s for r in by_name.get("vanilla 1F1B", []) if r.startup_s == r.startup_s]
        if starts:
            say(f"vanilla checkpoint-restart model: restart {statistics.median(starts):.1f} s (measured launch to first "
                f"iteration), checkpoint every {args.checkpoint_interval} iterations (half lost per failure), "
                f"{args.window} iterations after the failures, no spares (restart on the whole pipelines)")


def plot(results: list[Result], args: argparse.Namespace, costs_by_shape: dict[tuple[int, int], CostModel],
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple[int, int, int], list[Result]] = {}
    for r in results:
        groups.setdefault((r.stages, r.pipelines, r.microbatches), []).append(r)
    fig, axes = plt.subplots(1, len(groups), figsize=(max(10.0, 4.6 * len(groups)), 5.0), squeeze=False)
    for ax, ((s, d, m), rs) in zip(axes[0], groups.items()):
        costs = costs_by_shape[(s, d)]
        samples = d * m

        def tput(name_filter: Any, rs: list[Result] = rs, samples: int = samples) -> dict[int, list[float]]:
            out: dict[int, list[float]] = {}
            for r in rs:
                if r.ok and r.times and name_filter(r.case):
                    out.setdefault(len(r.case.failed), []).append(samples / r.per_iteration)
            return out

        def spread(c: Case) -> bool:
            return len({st for _, st in c.failed}) > 1

        rc_kill = tput(lambda c: c.killed)
        vans = [r for r in rs if r.case.engine == "vanilla" and r.ok and r.times]
        v = statistics.median(r.per_iteration for r in vans) if vans else None
        start = statistics.median(r.startup_s for r in vans) if vans else None
        bx: list[int] = []
        vanilla_sets: dict[int, tuple[Worker, ...]] = {}
        for label, wanted, color, style in (("one stage", False, "C0", "o-"), ("several stages", True, "C1", "D-")):
            series = tput(lambda c, wanted=wanted: c.engine == "recycle" and c.schedule == "adaptive"
                          and not c.killed and (len(c.failed) <= 1 or spread(c) == wanted))
            sets = {len(r.case.failed): r.case.failed for r in rs if r.case.engine == "recycle" and not r.case.killed
                    and r.case.schedule == "adaptive" and (len(r.case.failed) <= 1 or spread(r.case) == wanted)}
            xs = sorted(series)
            bx = sorted(set(bx) | set(xs))
            ax.plot(xs, [statistics.median(series[x]) for x in xs], style, color=color,
                    label=f"ds_recycle, failures in {label}")
            ax.plot(xs, [samples / (lower_bound(s, d, m, costs, sets[x]) / 1e3) for x in xs], "--", color=color,
                    alpha=0.6, label=f"bound, failures in {label}")
            for x in xs:  # the figure's failure sets of one size hit as many pipelines: vanilla restarts on the rest
                vanilla_sets.setdefault(x, sets[x])
        if v is not None and start is not None:
            vx = sorted(vanilla_sets)
            ax.plot(vx, [samples / vanilla_restart_model(v, start, vanilla_sets[x], d, args.checkpoint_interval,
                                                         args.window) for x in vx],
                    "^:", color="C3", label="vanilla DeepSpeed, checkpoint-restart (model)")
        if rc_kill:
            kx = sorted(rc_kill)
            ax.plot(kx, [statistics.median(rc_kill[x]) for x in kx], "s", color="C2", label="ds_recycle, killed mid-run")
        ax.set_xlabel("failed workers")
        ax.set_ylabel("throughput (samples/s)")
        ax.set_title(f"{s} x {d}, M = {m} (emulated accelerators)")
        ax.set_xticks(bx)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    legend: dict[str, Any] = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend), loc="lower center", bbox_to_anchor=(0.5, 0.03), ncol=3,
               fontsize=8, frameon=False)
    fig.text(0.5, 0.005, "failed workers absent from the start unless killed mid-run; bound: throughput at the lower "
             "bound of the time per iteration; every ds_recycle point measured on emulated accelerators", ha="center",
             fontsize=7)
    fig.tight_layout(rect=(0.0, 0.15, 1.0, 1.0))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------------------------------------- main
DEFAULT_F_MS = "4x4=100,8x4=200"
"""Slowest F per shape: twice the workers get twice the time, so the runtime's CPU takes the same share of the cores."""


def f_ms_for(spec: str, stages: int, pipelines: int) -> float:
    """The slowest stage's emulated F for an ``S x D`` job from ``--f-ms`` (see :data:`DEFAULT_F_MS`)."""
    pairs: dict[str, float] = {}
    try:
        if "=" not in spec:
            return float(spec)
        for item in spec.split(","):
            shape, ms = item.split("=")
            pairs[shape.strip().lower()] = float(ms)
    except ValueError:
        raise SystemExit(f"--f-ms {spec!r}: give a number of ms, or SxD=ms pairs such as {DEFAULT_F_MS}") from None
    return pairs.get(f"{stages}x{pipelines}", 100.0 * max(1.0, stages * pipelines / 16))


def measure_comm_ms() -> float:
    from benchmarks.emulated.model import SEQ, WIDTH
    from benchmarks.profile_ops import measure_comm
    return measure_comm(SEQ * WIDTH, 200)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="4x4,8x4", help="comma-separated SxD")
    p.add_argument("--microbatches", default="S,2S", help="comma-separated: numbers, S or 2S")
    p.add_argument("--cases", choices=("all", "core", "failure-free"), default="all")
    p.add_argument("--only", default=None, help="regex: run only the cases whose name matches")
    p.add_argument("--profile", choices=PROFILES, default="gpt3-2.7b")
    p.add_argument("--f-ms", default=DEFAULT_F_MS,
                   help="emulated F of the slowest stage, ms: one number for every shape, or SxD=ms pairs "
                        "(a shape not named gets 100 ms per 16 workers)")
    p.add_argument("--costs-file", default=None,
                   help="costs for the planner (runtime and prediction); default: the emulated profile itself")
    p.add_argument("--feed-back", action="store_true",
                   help="after the runs, write the fed-back costs file (profile + measured overhead) next to --out")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--kill-at", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--checkpoint-interval", type=int, default=50)
    p.add_argument("--window", type=int, default=500)
    p.add_argument("--out", default=None, help="report file (.txt; .json and .png next to it)")
    p.add_argument("--workdir", default=str(REPO / "runs" / "emulated"))
    p.add_argument("--comm-ms", type=float, default=None,
                   help="p2p time for the fed-back costs (default: measured now by a gloo ping-pong)")
    p.add_argument("--report-from", default=None, nargs="+",
                   help="no runs: report the results of earlier runs (their .jsonl files) with this command's options")
    args = p.parse_args()
    work = Path(args.workdir)
    lines: list[str] = []
    results: list[Result] = []
    costs_by_shape: dict[tuple[int, int], CostModel] = {}
    profiles: dict[tuple[int, int], dict[str, Any]] = {}
    plan_cases: list[tuple[int, int, int, Case, Path, Path]] = []
    shapes = args.shapes.split(",")
    if args.costs_file and len(shapes) > 1:
        p.error(f"--costs-file holds the costs of one shape and --shapes names {len(shapes)}: give one shape")
    for shape in shapes:
        try:
            s, d = (int(x) for x in shape.lower().split("x"))
        except ValueError:
            p.error(f"--shapes {args.shapes!r}: give SxD pairs such as 4x4,8x4")
        prof = profile(args.profile, s, d, f_ms_for(args.f_ms, s, d))
        profiles[(s, d)] = prof
        pfile = write_profile(work / f"profile-{s}x{d}.json", prof)
        cfile = Path(args.costs_file).resolve() if args.costs_file else pfile
        costs_by_shape[(s, d)] = CostModel.from_file(cfile)
        for mtext in args.microbatches.split(","):
            m = {"S": s, "2S": 2 * s}.get(mtext.strip(), None) or int(mtext)
            for case in cases_for(s, d, args.cases, args.kill_at):
                if args.only is None or re.search(args.only, case.name):
                    plan_cases.append((s, d, m, case, pfile, cfile))
    import deepspeed
    import torch

    say_head = [f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}, "
                f"deepspeed {deepspeed.__version__}",
                f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores, "
                f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2 ** 30:.0f} GiB; "
                f"load average at start {os.getloadavg()[0]:.1f}",
                f"command: {' '.join(['.venv/bin/python', 'benchmarks/emulated_figure.py', *sys.argv[1:]])}",
                "EMULATED ACCELERATORS: F, B, W sleep the profile's time (benchmarks/emulated/); the runtime, "
                "transport, optimizer and all-reduce run for real",
                f"profile {args.profile}, slowest F (ms) {args.f_ms}; {args.steps} steps, {args.warmup} warm-up; "
                f"{args.rounds} round(s), cases alternated",
                "columns: s/iter measured (median over the timed steps); plan = the planner's time for the runtime's "
                "plan with the runtime's costs; meas/pl; plan+fb = the same plan re-timed with the fed-back costs; "
                "bound = lower bound of the failure set; kept = failure-free adaptive time / this time; samp/s; "
                "cpu ms/op = all workers' process CPU / (3 S D M) per iteration; %core/w = one worker's CPU share of "
                "a core; job cpu = the workers' share of all cores, +launch = with the launcher and its store; "
                "busy = whole machine (other users too); load = load average; recov s = kill to first full "
                "iteration; RSS GB = sum over the job's processes; mem GB = drop of MemAvailable"]
    for (s, d), prof in profiles.items():
        say_head.append(f"profile {s}x{d} (ms): F {prof['F']} B {prof['B']} W {prof['W']}; {prof['source']}")
    for (s, d), c in costs_by_shape.items():
        say_head.append(f"planner costs {s}x{d} (ms): {json.dumps(c.to_json())}")
    for line in say_head:
        print(line, flush=True)
    lines += say_head
    partial = Path(args.out).with_suffix(".jsonl") if args.out else work / "results.jsonl"
    if args.report_from:
        plan_cases = []
        for f in args.report_from:
            results += [result_from_json(json.loads(line)) for line in Path(f).read_text().splitlines() if line]
            lines.append(f"results read from {f}")
    else:
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text("")
    for r in range(args.rounds if plan_cases else 0):
        for i, (s, d, m, case, pfile, cfile) in enumerate(plan_cases):
            tag = re.sub(r"[^a-z0-9]+", "-", case.name.lower()).strip("-")
            res = run_case(case, s, d, m, args.steps, args.warmup, pfile, cfile, work / f"{s}x{d}-m{m}-{tag}-r{r}")
            results.append(res)
            with partial.open("a") as f:
                f.write(json.dumps(result_json(res)) + "\n")
            print(f"  [{i + 1}/{len(plan_cases)} round {r + 1}] {s}x{d} M={m} {case.name}: "
                  f"{res.per_iteration:.3f} s/iter, cpu {res.cpu_ms_per_op():.2f} ms/op, busy "
                  f"{100 * res.machine_busy:.0f}%, load {res.load:.1f}"
                  + ("" if res.ok else f"  FAILED: {res.note}"), flush=True)
    comm = args.comm_ms if args.comm_ms is not None else measure_comm_ms()
    report(results, args, costs_by_shape, lines, comm)
    if args.feed_back:
        for (s, d), prof in profiles.items():
            ff = [r for r in results if (r.stages, r.pipelines) == (s, d) and r.case.engine == "recycle"
                  and not r.case.failed and r.ok]
            if not ff:
                continue
            per_op = statistics.median(r.cpu_ms_per_op() for r in ff)
            path = work / f"fed-back-{s}x{d}.json"
            path.write_text(json.dumps(fed_back(prof, per_op, comm, 0.0), indent=1) + "\n")
            msg = f"fed-back costs file {s}x{d}: {path} (+{per_op:.2f} ms a F/B/W, comm {comm:.3f} ms)"
            print(msg)
            lines.append(msg)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n")
        plot(results, args, costs_by_shape, out.with_suffix(".png"))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
