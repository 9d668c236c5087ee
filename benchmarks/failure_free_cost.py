"""What ds_recycle costs when nothing fails: wall time, CPU seconds and peak memory per iteration, next to vanilla.

    .venv/bin/python benchmarks/failure_free_cost.py                       # every setup, 3 alternated rounds
    .venv/bin/python benchmarks/failure_free_cost.py --setups gpt-2x2 --rounds 5 --steps 30

Setups: the built-in GPT (``launch/train.py``) on 2 stages x 1 pipeline (``configs/gpt_cpu_2x1.json``) and
2 x 2 (``configs/gpt_cpu_2x2.json``), and the user-style script ``tests/byom/user_train.py`` (2 x 2, the model of
``--user-model``). Variants of each, alternated round by round (in reverse order every other round) so that
machine load hits all alike:

- ``vanilla``: DeepSpeed's stock ``PipelineEngine`` under torchrun;
- ``recycle``: the ds_recycle engine on the 1F1B plan under torchrun (no failure handling);
- ``recycle-zb``: the same with the ZB-H1 plan (GPT setups only; the B/W split's extra autograd calls);
- ``launch``: the ds_recycle engine on the 1F1B plan under ``ds-recycle launch`` (failure handling on).

While a job runs, a sampler thread reads every worker's ``/proc/<pid>/stat`` (user + system CPU time) and
``/proc/<pid>/status`` (``VmHWM``: peak resident memory) every ``--sample-ms`` and notes, at each
iteration the job reports (a metrics line of ``train.py``, a ``step N loss`` line of the user script), the
time and every worker's CPU time. Per job: wall seconds per iteration and CPU seconds per iteration per worker
(the mean over workers) from iteration ``--warmup`` to the last, and the largest peak RSS over its workers.
Each figure is the median over rounds; the ratios divide medians measured in the same run. Model-state bytes
are one stage's parameters + gradients + two Adam moments (fp32: 16 bytes a parameter), counted by building
each stage's ``PipelineModule`` part in a small gloo job here; the largest stage is shown. Under ``launch``, the
largest boundary-log peak a worker reported at the end of training (``boundary log peak N bytes``: the tensors
recovery keeps referenced, see ``docs/failures.md``) is shown next to it, and as a fraction of it.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ds_recycle.tools.procs import worker_pids  # noqa: E402
from tests.byom.harness import (  # noqa: E402
    USER_TRAIN,
    Job,
    script_args,
    start_ds_recycle,
    start_torchrun,
    write_recycle_variant,
)

TRAIN = ROOT / "launch" / "train.py"
CLOCK_TICK = os.sysconf("SC_CLK_TCK")
_STEP = re.compile(r"^(?:\[rank \d+\] )?step \d+ loss ")
_LOG_PEAK = re.compile(r"boundary log peak (\d+) bytes")


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` (None when it is gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICK


def _peak_rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass
class Sample:
    """The job's progress as the sampler saw it."""

    stamps: dict[int, tuple[float, dict[int, float]]] = field(default_factory=dict)
    """iterations done -> (monotonic time first seen, CPU seconds of every worker pid then)."""
    peak_rss: dict[int, int] = field(default_factory=dict)
    workers: int = 0


class Sampler:
    """Reads the workers' CPU time and peak RSS every ``period_s`` (see the module docstring)."""

    def __init__(self, job: Job, progress: Callable[[], int], period_s: float) -> None:
        self.job, self.progress, self.period_s = job, progress, period_s
        self.sample = Sample()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pids: dict[int, int] = {}
        next_scan = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_scan:  # workers appear after start-up; a scan of /proc costs more than a read
                with contextlib.suppress(Exception):
                    pids = worker_pids(self.job.proc.pid) or pids
                next_scan = now + 1.0
            done = self.progress()
            cpu = {pid: c for pid in pids.values() if (c := _cpu_s(pid)) is not None}
            for pid in pids.values():
                rss = _peak_rss(pid)
                if rss is not None:
                    self.sample.peak_rss[pid] = max(rss, self.sample.peak_rss.get(pid, 0))
            self.sample.workers = max(self.sample.workers, len(pids))
            if done not in self.sample.stamps and cpu and len(cpu) == len(pids):
                self.sample.stamps[done] = (now, cpu)
            self._stop.wait(self.period_s)

    def stop(self) -> Sample:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.sample


@dataclass(frozen=True)
class Figures:
    s_per_iter: float
    cpu_s_per_iter: float
    """Mean over the workers of each one's CPU seconds per iteration."""
    peak_rss: int
    """Largest peak RSS over the workers (bytes)."""
    log_peak: int | None = None
    """Largest boundary-log peak a worker reported at the end of training (bytes; None: not reported)."""


def _figures(sample: Sample, warmup: int, workers: int) -> Figures:
    done = sorted(n for n in sample.stamps if n >= warmup)
    if len(done) < 2 or sample.workers != workers:
        raise RuntimeError(f"too few iterations sampled ({done}) or workers ({sample.workers} of {workers})")
    (t0, c0), (t1, c1) = sample.stamps[done[0]], sample.stamps[done[-1]]
    n = done[-1] - done[0]
    common = set(c0) & set(c1)
    cpu = statistics.mean(c1[p] - c0[p] for p in common) / n
    return Figures((t1 - t0) / n, cpu, max(sample.peak_rss.values()))


@dataclass(frozen=True)
class Variant:
    name: str
    start: Callable[[Path], Job]
    progress: Callable[[Job, Path], int]
    workers: int


def _metrics_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


def _step_lines(job: Job) -> int:
    return sum(1 for line in list(job.lines) if _STEP.match(line))


def _gpt_config(base: dict, tmp: Path, name: str, pipelines: int, schedule: str | None) -> Path:
    cfg = json.loads(json.dumps(base))
    cfg.pop("train_batch_size", None)
    cfg["recycle"].update({"pipelines": pipelines, "enabled": schedule is not None})
    if schedule is not None:
        cfg["recycle"]["schedule"] = schedule
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return path


def gpt_variants(config: Path, pipelines: int, steps: int, tmp: Path) -> list[Variant]:
    base = json.loads(config.read_text())
    nproc = 2 * pipelines

    def train(cfg: Path, vanilla: bool, launch: bool) -> Callable[[Path], Job]:
        def start(work: Path) -> Job:
            args = ["--deepspeed_config", str(cfg), "--steps", str(steps), "--metrics", str(work / "metrics.jsonl")]
            args += ["--vanilla"] if vanilla else []
            (work / "metrics.jsonl").unlink(missing_ok=True)
            if launch:
                return start_ds_recycle(TRAIN, args, work, nproc=nproc, pythonpath=())
            return start_torchrun(TRAIN, args, work, nproc=nproc, pythonpath=())
        return start

    def progress(job: Job, work: Path) -> int:
        return _metrics_lines(work / "metrics.jsonl")

    v = _gpt_config(base, tmp, f"vanilla{pipelines}", pipelines, None)
    a = _gpt_config(base, tmp, f"1f1b{pipelines}", pipelines, "1f1b")
    z = _gpt_config(base, tmp, f"zb{pipelines}", pipelines, "zb-h1")
    return [Variant("vanilla", train(v, True, False), progress, nproc),
            Variant("recycle", train(a, False, False), progress, nproc),
            Variant("recycle-zb", train(z, False, False), progress, nproc),
            Variant("launch", train(a, False, True), progress, nproc)]


def user_variants(model: str, steps: int, tmp: Path) -> list[Variant]:
    variant = write_recycle_variant(USER_TRAIN, tmp / "variant")
    args = script_args(model, steps=steps)

    def progress(job: Job, work: Path) -> int:
        return _step_lines(job)

    return [Variant("vanilla", lambda w: start_torchrun(USER_TRAIN, args, w), progress, 4),
            Variant("recycle", lambda w: start_torchrun(variant, args, w), progress, 4),
            Variant("launch", lambda w: start_ds_recycle(variant, args, w), progress, 4)]


# ---------------------------------------------------------------------------------------------- model state
def _count_stage(rank: int, stages: int, port: int, what: str, out: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(stages), "LOCAL_RANK": str(rank), "DS_ACCELERATOR": "cpu"})
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed("gloo")
    kind, arg = what.split(":", 1)
    if kind == "gpt":
        from ds_recycle.config.schema import GPTConfig
        from ds_recycle.model import build_pipeline_module

        sizes = json.loads(Path(arg).read_text())["recycle"].get("model", {})
        module = build_pipeline_module(GPTConfig(**sizes), stages)
    else:
        sys.path.insert(0, str(USER_TRAIN.parent))
        import models  # type: ignore[import-not-found]

        module, _ = models.build(arg, num_stages=stages, seed=1234)
    Path(f"{out}.{rank}").write_text(str(sum(p.numel() for p in module.parameters())))
    dist.barrier()
    dist.destroy_process_group()


def model_state_bytes(what: str, stages: int, tmp: Path) -> int:
    """Largest stage's parameters + gradients + two Adam moments, in fp32 bytes."""
    import torch.multiprocessing as mp

    from tests.byom.harness import free_port

    out = str(tmp / f"params-{what.replace('/', '_').replace(':', '_')}")
    mp.start_processes(_count_stage, args=(stages, free_port(), what, out), nprocs=stages, start_method="spawn")
    return max(int(Path(f"{out}.{r}").read_text()) for r in range(stages)) * 4 * 4


# ---------------------------------------------------------------------------------------------- running
def run_setup(variants: list[Variant], rounds: int, warmup: int, sample_s: float, tmp: Path,
              loads: list[float]) -> dict[str, list[Figures]]:
    got: dict[str, list[Figures]] = {v.name: [] for v in variants}
    for r in range(rounds):
        for v in variants if r % 2 == 0 else variants[::-1]:  # no variant always runs first or last
            work = tmp / f"{v.name}-{r}-{time.monotonic_ns()}"
            work.mkdir(parents=True)
            with v.start(work) as job:
                sampler = Sampler(job, functools.partial(v.progress, job, work), sample_s)
                try:
                    job.result(900.0).check()
                finally:
                    sample = sampler.stop()
            peaks = [int(m) for m in _LOG_PEAK.findall(job.log)]
            got[v.name].append(replace(_figures(sample, warmup, v.workers), log_peak=max(peaks) if peaks else None))
            loads.append(os.getloadavg()[0])
            f = got[v.name][-1]
            print(f"  round {r} {v.name:<11} {f.s_per_iter:.4f} s/iter  {f.cpu_s_per_iter:.4f} cpu-s/iter/worker  "
                  f"peak rss {f.peak_rss / 2**20:.0f} MiB", flush=True)
    return got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", nargs="+", choices=("gpt-2x1", "gpt-2x2", "user"),
                   default=["gpt-2x1", "gpt-2x2", "user"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="iterations left out at the start")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--user-model", default="gpt", choices=("alexnet", "gpt", "tuple", "mlp"))
    p.add_argument("--user-steps", type=int, default=40)
    p.add_argument("--sample-ms", type=float, default=20.0)
    p.add_argument("--out", default=None, help="also write the report to this file")
    args = p.parse_args(argv)
    started = time.gmtime()
    loads = [os.getloadavg()[0]]
    tables: dict[str, tuple[dict[str, list[Figures]], int]] = {}
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        for setup in args.setups:
            print(f"{setup}:", flush=True)
            if setup == "user":
                variants = user_variants(args.user_model, args.user_steps, tmp)
                state = model_state_bytes(f"user:{args.user_model}", 2, tmp)
            else:
                pipelines = 1 if setup == "gpt-2x1" else 2
                config = ROOT / "configs" / f"gpt_cpu_2x{pipelines}.json"
                variants = gpt_variants(config, pipelines, args.steps, tmp)
                state = model_state_bytes(f"gpt:{config}", 2, tmp)
            tables[setup] = (run_setup(variants, args.rounds, args.warmup, args.sample_ms / 1e3, tmp, loads), state)
    report = _report(tables, args, started, loads)
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    return 0


def _report(tables: dict[str, tuple[dict[str, list[Figures]], int]], args: argparse.Namespace,
            started: time.struct_time, loads: list[float]) -> str:
    import deepspeed
    import torch

    lines = [f"date: {time.strftime('%Y-%m-%d %H:%M', started)}-{time.strftime('%H:%M UTC', time.gmtime())}; "
             f"torch {torch.__version__}, deepspeed {deepspeed.__version__}",
             f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores; load average (1 min) during "
             f"the runs {min(loads):.1f}-{max(loads):.1f}",
             f"command: {' '.join(['python', *sys.argv])}",
             f"steps {args.steps} (user script {args.user_steps}, model {args.user_model}), iterations from "
             f"{args.warmup} on, {args.rounds} alternated rounds, medians; OMP_NUM_THREADS=1, real compute on CPU",
             "vanilla: DeepSpeed under torchrun; recycle: ds_recycle engine, 1F1B plan, torchrun; recycle-zb: ZB-H1 "
             "plan; launch: 1F1B under ds-recycle launch (failure handling on)", "",
             f"{'setup':<9}{'variant':<12}{'s/iter':>8}{'x vanilla':>10}{'cpu-s/iter':>11}{'x vanilla':>10}"
             f"{'peak RSS MiB':>13}{'state MiB':>10}{'log MiB':>9}{'log/state':>10}"]
    for setup, (figs, state) in tables.items():
        base = figs["vanilla"]
        t0 = statistics.median(f.s_per_iter for f in base)
        c0 = statistics.median(f.cpu_s_per_iter for f in base)
        for name, values in figs.items():
            t = statistics.median(f.s_per_iter for f in values)
            c = statistics.median(f.cpu_s_per_iter for f in values)
            rss = statistics.median(f.peak_rss for f in values)
            logs = [f.log_peak for f in values if f.log_peak is not None]
            log = (f"{max(logs) / 2**20:>9.2f}{max(logs) / state:>10.3f}" if logs else f"{'-':>9}{'-':>10}")
            lines.append(f"{setup:<9}{name:<12}{t:>8.4f}{t / t0:>10.3f}{c:>11.4f}{c / c0:>10.3f}"
                         f"{rss / 2**20:>13.0f}{state / 2**20:>10.2f}{log}")
        if "launch" in figs and "recycle" in figs:
            tl = statistics.median(f.s_per_iter for f in figs["launch"])
            tr = statistics.median(f.s_per_iter for f in figs["recycle"])
            cl = statistics.median(f.cpu_s_per_iter for f in figs["launch"])
            cr = statistics.median(f.cpu_s_per_iter for f in figs["recycle"])
            lines.append(f"{setup:<9}failure handling on top (launch / recycle): time {tl / tr:.3f}, "
                         f"cpu {cl / cr:.3f}")
    lines.append("per-round values (s/iter): " + "; ".join(
        f"{s} {n} " + " ".join(f"{f.s_per_iter:.4f}" for f in v) for s, (figs, _) in tables.items()
        for n, v in figs.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
