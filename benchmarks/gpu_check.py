"""What ds_recycle does on a GPU, checked by one command that prints one table.

    python benchmarks/gpu_check.py [--wheels DIR] [--out FILE] [--repeats 5]   # a machine with a GPU
    python benchmarks/gpu_check.py --dry-run                                   # any machine, on CPU (CI)

Each part runs in a subprocess of its own under a hard time limit, so a hang fails its row and never the script:

(a) the default GPT at 2 x 2 under ``ds-recycle launch``, four workers sharing one GPU (gloo through host memory):
    its final model against the same job's on the CPU, and the job again with rank 1 SIGKILLed from outside and
    restarted, which must end bit-identical to the failure-free run;
(b) what the B/W split costs on real kernels: F + B + W against F + fused backward for a stack of GPT blocks in
    bf16 (d_model 4096, sequence 2048, micro-batches 1, 2 and 4): milliseconds, peak memory, the ratio, and how
    far the split's gradients are from the fused ones; beside it, what keeping the boundary log in pinned host
    memory (``recycle.boundary_log: "pinned_host"``) pays a boundary tensor: its copy there;
(c) NCCL on one rank: the engine's own epoch groups (``resilience/nccl.py``: p2p, norm and stage communicators,
    unregistered, nonblocking, eagerly connected, under a fresh store prefix each time), used, retired (aborted
    together in one NCCL group) and built again five times, with timings; then a receive nobody sends, whose polled
    wait ends once the detector says a member died, the epoch retired, and the GPU checked healthy afterwards;
(d) with two or more GPUs, a job over the NCCL transport, one GPU per worker (2 x 2 on four GPUs, 1 x 2 on two),
    failure-free and with an outside kill and restart, which must end bit-identical.

A part that cannot run here says why in its row ("not run: ..."); it is never counted as passed. The script exits 1
when a part that ran failed.

``--dry-run`` runs the same code on CPU at a tiny size so that it cannot rot (``tests/benchmarks``): (a) with 8
iterations of a 2-layer GPT of width 64, both jobs on the CPU; (b) with d_model 128, sequence 64; (c) on gloo,
whose abort cannot release a pending receive, so that half is not run; (d) not at all (its jobs are (a)'s code on
another config). ``--parts`` picks parts (``--parts bc``); ``--work DIR`` keeps (a)'s and (d)'s logs and models (in
``DIR/a`` and ``DIR/d``).
``--wheels DIR`` first installs the wheels in DIR (``pip --no-index --no-deps --target``) for the parts'
subprocesses: a GPU machine without network gets DeepSpeed that way.
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
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PART_TIMEOUT_S = {"a": 330.0, "b": 120.0, "c": 60.0, "d": 230.0}
_NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0", "NCCL_NVLS_ENABLE": "0"}
"""What keeps torch's NCCL watchdog from taking a process down when a communicator is aborted on purpose."""


@dataclass(frozen=True)
class Row:
    """One line of the table: the part, what it measured, and ``ok``, ``FAILED: ...`` or ``not run: ...``."""

    part: str
    setting: str
    result: str
    status: str

    @property
    def failed(self) -> bool:
        return self.status.startswith("FAILED")


# ---------------------------------------------------------------------------------------------- (a) the job
JOB_STEPS = {False: 120, True: 8}
"""Iterations of (a)'s jobs, on a GPU and in the dry run. The outside kill comes at iteration ``_kill_at``, early
enough on a GPU for the restarted worker (a new process: imports, CUDA, the join) to rejoin before the end."""


DRY_MODEL = {"n_layer": 2, "d_model": 64, "n_head": 2, "seq_len": 32}
"""(a)'s GPT in the dry run, in place of the default's sizes."""


JOB_TIMEOUT_S = 100.0
"""Longest one of (a)'s jobs may run: past it the job is stopped (its workers with it) and the part fails."""


def _kill_at(steps: int) -> int:
    return min(10, steps // 3)
CPU_GPU_RTOL = 1e-2
"""(a)'s bound on the GPU run's distance from the CPU run, per tensor, relative to its largest element: fp32
kernels of another device sum in other orders, and Adam's normalised steps carry such last-bit differences of
small gradients into the weights at the learning rate's size."""


def _job_config(work: Path, dry: bool, name: str = "config", **recycle: Any) -> Path:
    """The default GPT's config for the check's jobs (``recycle`` merged into its section), written into ``work``."""
    config = json.loads((ROOT / "configs" / "gpt_cpu_2x2.json").read_text())
    config["optimizer"]["params"]["torch_adam"] = True  # the same optimizer code on both devices, nothing compiled
    if dry:  # the same job at a tiny size: the path is what the dry run keeps from rotting
        config["recycle"]["model"].update(DRY_MODEL)
    config["recycle"].update(recycle)
    path = work / f"{name}.json"
    path.write_text(json.dumps(config))
    return path


def _run_job(work: Path, config: Path, workers: int, steps: int, name: str, env: dict[str, str],
             kill_at: int | None = None) -> dict[str, Any]:
    """One job under ``ds-recycle launch``, bounded by :data:`JOB_TIMEOUT_S`; with ``kill_at``, rank 1 SIGKILLed from
    outside at that iteration and restarted by the launcher. Its final model file, wall time, device, final loss,
    live workers at the end, events, and how many workers shrank a failed epoch's NCCL communicators."""
    from ds_recycle.tools.jobs import Launcher, MetricsTail, TrainJob

    out, metrics, log = work / f"{name}.pt", work / f"{name}.jsonl", work / f"{name}.log"
    argv = ["--deepspeed_config", str(config), "--steps", str(steps), "--metrics", str(metrics), "--save-final", str(out)]
    launcher_args = ["--restart_failed_after", "1"] if kill_at is not None else []
    began, killed = time.perf_counter(), None
    env = {"WANDB_MODE": "disabled", "PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT)), **env}
    with TrainJob.start(Launcher.RECYCLE, workers, argv, log, launcher_args, env=env) as job:
        tail = MetricsTail(metrics)
        while job.running:
            if time.perf_counter() - began > JOB_TIMEOUT_S:
                raise RuntimeError(f"{name}: no end within {JOB_TIMEOUT_S:.0f} s; see {log}")
            tail.poll()
            if kill_at is not None and killed is None and tail.last is not None and tail.last["iter"] >= kill_at:
                killed = job.kill_rank(1)
            time.sleep(0.05)
        code = job.proc.returncode
    text = log.read_text(errors="replace")
    if code != 0 or not out.is_file():
        raise RuntimeError(f"{name}: launcher exit {code}; last lines: " + " | ".join(text.splitlines()[-4:]))
    if kill_at is not None and killed is None:
        raise RuntimeError(f"{name}: rank 1 was never killed (iteration {kill_at} not seen in time)")
    tail.poll()
    records = [r for life in tail.lives for r in life]
    device = next((line.split(" on ", 1)[1] for line in text.splitlines() if f"rank 0 of {workers} on " in line), "?")
    return {"state": out, "wall_s": time.perf_counter() - began, "device": device,
            "final_loss": records[-1]["loss"], "live_after": records[-1].get("live_workers"),
            "events": sorted({e.get("kind", "?") for r in records for e in r.get("events", [])}),
            "shrinks": sum("NCCL communicators shrunk in" in line for line in text.splitlines())}


def _diff(a: Path, b: Path) -> dict[str, Any]:
    """How far model file ``a`` is from ``b``: tensors, bit-identical or not, the largest differences."""
    import torch

    from ds_recycle.tools.compare import compare_state_dicts

    ds = compare_state_dicts(torch.load(a, map_location="cpu", weights_only=True),
                             torch.load(b, map_location="cpu", weights_only=True), rtol=0.0)
    return {"tensors": len(ds), "identical": all(d.max_abs == 0.0 for d in ds),
            "max_rel": max(d.max_rel for d in ds), "max_abs": max(d.max_abs for d in ds)}


def _reported(job: dict[str, Any]) -> dict[str, Any]:
    """A job's JSON result: all but the model file."""
    return {k: v for k, v in job.items() if k != "state"}


def _work(work: Path | None, part: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix=f"gpu_check_{part}_")) if work is None else work / part
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _job_part(dry: bool, work: Path | None = None) -> dict[str, Any]:
    """(a): the default GPT's 2 x 2 job three times under ``ds-recycle launch``: failure-free on the GPU (four
    workers sharing it), failure-free on the CPU, and on the GPU with rank 1 SIGKILLed from outside and restarted
    by the launcher. In the dry run the GPU's jobs run on the CPU and the CPU's is not run."""
    steps = JOB_STEPS[dry]
    folder = _work(work, "a")
    config = _job_config(folder, dry)
    gpu = _run_job(folder, config, 4, steps, "gpu", {})
    killed = _run_job(folder, config, 4, steps, "gpu_killed", {}, kill_at=_kill_at(steps))
    out: dict[str, Any] = {"steps": steps, "gpu": _reported(gpu), "killed": _reported(killed),
                           "killed_vs_gpu": _diff(killed["state"], gpu["state"])}
    if not dry:
        cpu = _run_job(folder, config, 4, steps, "cpu", {"CUDA_VISIBLE_DEVICES": ""})
        out["cpu"] = _reported(cpu)
        out["gpu_vs_cpu"] = _diff(gpu["state"], cpu["state"])
    return out


def _nccl_job_part(dry: bool, work: Path | None = None) -> dict[str, Any]:
    """(d): on two or more GPUs, a job over the NCCL transport, one GPU per worker (the default GPT at 2 x 2 on four
    GPUs, at 1 x 2 on two or three), failure-free and with rank 1 SIGKILLed from outside and restarted: the two
    models must be bit-identical."""
    steps = JOB_STEPS[dry]
    gpus = _gpus()
    stages = 2 if gpus >= 4 else 1
    folder = _work(work, "d")
    config = _job_config(folder, dry, "nccl", transport="nccl", stages=stages, pipelines=2)
    free = _run_job(folder, config, 2 * stages, steps, "nccl", {})
    killed = _run_job(folder, config, 2 * stages, steps, "nccl_killed", {}, kill_at=_kill_at(steps))
    return {"steps": steps, "shape": f"{stages} x 2", "free": _reported(free), "killed": _reported(killed),
            "killed_vs_free": _diff(killed["state"], free["state"])}


def _nccl_job_rows(result: dict[str, Any], dry: bool) -> list[Row]:
    free, killed, d = result["free"], result["killed"], result["killed_vs_free"]
    ok = d["identical"] and "failure" in killed["events"]
    same = "bit-identical" if d["identical"] else f"max rel {d['max_rel']:.1e}"
    return [Row("d", f"NCCL, default GPT {result['shape']}, {result['steps']} it, one GPU per worker ({free['device']} "
                     f"...), rank 1 SIGKILLed from outside at iteration {_kill_at(result['steps'])}, restarted",
                f"events {', '.join(killed['events']) or 'none'}; {killed['live_after']} live at the end; "
                f"{killed['shrinks']} survivor(s) shrank the failed epoch's communicators (recycle.nccl_shrink; none: "
                f"built afresh); against the failure-free NCCL run: {same} ({d['tensors']} tensors); "
                f"{free['wall_s']:.0f} s free, "
                f"{killed['wall_s']:.0f} s killed", "ok" if ok else "FAILED: not the failure-free model, or no failure")]


def _job_rows(result: dict[str, Any], dry: bool) -> list[Row]:
    steps, gpu, killed = result["steps"], result["gpu"], result["killed"]
    where = "CPU (dry run: 2 layers of width 64)" if dry else gpu["device"]
    rows = []
    if dry:
        rows.append(Row("a", "default GPT 2 x 2: the GPU run against the CPU run", "-", "not run: no GPU (dry run)"))
    else:
        cpu, d = result["cpu"], result["gpu_vs_cpu"]
        ok = d["max_rel"] <= CPU_GPU_RTOL and gpu["device"].startswith("cuda")
        rows.append(Row("a", f"default GPT 2 x 2, {steps} it, 4 workers on {gpu['device']}, against the same job on "
                             "CPU", f"{d['tensors']} tensors: max |gpu - cpu| / max |cpu| {d['max_rel']:.1e} (bound "
                             f"{CPU_GPU_RTOL:.0e}); final loss {gpu['final_loss']:.5f} GPU, {cpu['final_loss']:.5f} "
                             f"CPU; {gpu['wall_s']:.0f} s GPU, {cpu['wall_s']:.0f} s CPU",
                       "ok" if ok else "FAILED: the GPU run is not the CPU run's model"))
    d = result["killed_vs_gpu"]
    # the restarted worker rejoins if the job lasts long enough after the kill; the model must be the same either way
    ok = d["identical"] and "failure" in killed["events"]
    same = "bit-identical" if d["identical"] else f"max rel {d['max_rel']:.1e}"
    rows.append(Row("a", f"the same on {where}, rank 1 SIGKILLed from outside at iteration {_kill_at(steps)}, restarted "
                         "1 s later", f"events {', '.join(killed['events']) or 'none'}; {killed['live_after']} live "
                         f"at the end; against the failure-free run: {same} ({d['tensors']} tensors); "
                         f"{killed['wall_s']:.0f} s",
                   "ok" if ok else "FAILED: not the failure-free model, or no failure recorded"))
    return rows


# ---------------------------------------------------------------------------------------------- (b) the split
@dataclass(frozen=True)
class SplitSize:
    d_model: int
    seq: int
    heads: int
    layers: int
    micro_batches: tuple[int, ...]


GPU_SPLIT = SplitSize(d_model=4096, seq=2048, heads=32, layers=4, micro_batches=(1, 2, 4))
DRY_SPLIT = SplitSize(d_model=128, seq=64, heads=4, layers=2, micro_batches=(1, 2))


def _split_part(dry: bool, repeats: int) -> list[dict[str, Any]]:
    """(b): per micro-batch size, medians of F, fused backward, B and W (ms), peak memory of each way, the gradient
    difference; and what ``recycle.boundary_log: "pinned_host"`` pays a boundary tensor (its copy to pinned host
    memory, waited for: ms)."""
    import torch

    from ds_recycle.config import GPTConfig
    from ds_recycle.engine.backward import OwnerCapture, backward_fused, backward_input
    from ds_recycle.engine.devices import offload
    from ds_recycle.model.gpt import Block

    size = DRY_SPLIT if dry else GPU_SPLIT
    device = torch.device("cpu" if dry else "cuda")
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, seq_len=size.seq, n_layer=size.layers, d_model=size.d_model, n_head=size.heads)
    stack = torch.nn.Sequential(*[Block(cfg) for _ in range(size.layers)]).to(device=device, dtype=torch.bfloat16)
    capture = OwnerCapture(stack)
    params = list(stack.parameters())

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def clock(fn: Callable[[], Any]) -> tuple[Any, float]:
        sync()
        start = time.perf_counter()
        out = fn()
        sync()
        return out, (time.perf_counter() - start) * 1e3

    def peak_reset() -> None:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def peak_gib() -> float:
        return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0

    def grads() -> list[torch.Tensor]:
        out = [p.grad.detach().float().clone() if p.grad is not None else torch.zeros(1) for p in params]
        for p in params:
            p.grad = None
        return out

    def fused(x: torch.Tensor, g: torch.Tensor) -> tuple[dict[str, float], list[torch.Tensor], float]:
        peak_reset()
        inp = x.clone().requires_grad_(True)
        out, f_ms = clock(lambda: stack(inp))
        _, b_ms = clock(lambda: backward_fused(out, g, inp, capture))
        return {"F": f_ms, "fused": b_ms}, grads(), peak_gib()

    def split(x: torch.Tensor, g: torch.Tensor) -> tuple[dict[str, float], list[torch.Tensor], float]:
        peak_reset()
        inp = x.clone().requires_grad_(True)
        with capture.capture() as captured:
            out, f_ms = clock(lambda: stack(inp))
        (_, work), b_ms = clock(lambda: backward_input(out, g, inp, captured, capture))
        _, w_ms = clock(work.run)
        return {"F": f_ms, "B": b_ms, "W": w_ms}, grads(), peak_gib()

    rows = []
    for mb in size.micro_batches:
        x = torch.randn(mb, size.seq, size.d_model, device=device, dtype=torch.bfloat16)
        g = torch.randn_like(x)
        for _ in range(2):  # warm-up: kernels chosen, allocator grown
            fused(x, g)
            split(x, g)
        times: dict[str, list[float]] = {}
        peaks: dict[str, float] = {"fused": 0.0, "split": 0.0}
        diff = 0.0
        for _ in range(repeats):  # alternated, so both ways see the same machine
            tf, gf, pf = fused(x, g)
            ts, gs, ps = split(x, g)
            times.setdefault("log", []).append(clock(partial(offload, x))[1])  # a boundary tensor to pinned host
            for k, v in tf.items():
                times.setdefault(f"fused.{k}", []).append(v)
            for k, v in ts.items():
                times.setdefault(f"split.{k}", []).append(v)
            peaks = {"fused": max(peaks["fused"], pf), "split": max(peaks["split"], ps)}
            diff = max(diff, max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(gs, gf)))
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"micro_batch": mb, **med, "peak_fused_gib": peaks["fused"], "peak_split_gib": peaks["split"],
                     "ratio": (med["split.F"] + med["split.B"] + med["split.W"]) / (med["fused.F"] + med["fused.fused"]),
                     "max_rel_grad_diff": diff})
    return rows


def _split_rows(result: list[dict[str, Any]], dry: bool) -> list[Row]:
    size = DRY_SPLIT if dry else GPU_SPLIT
    out = []
    for r in result:
        setting = (f"{size.layers} blocks d{size.d_model} s{size.seq} bf16 mb {r['micro_batch']}"
                   f"{' (CPU, dry run)' if dry else ''}")
        peak = "n/a on CPU" if dry else f"{r['peak_fused_gib']:.2f} / {r['peak_split_gib']:.2f} GiB"
        result_text = (f"F {r['fused.F']:.1f} + fused {r['fused.fused']:.1f} ms; F {r['split.F']:.1f} + B "
                       f"{r['split.B']:.1f} + W {r['split.W']:.1f} ms; ratio {r['ratio']:.3f}; peak (fused / split) "
                       f"{peak}; grad diff {r['max_rel_grad_diff']:.1e}; boundary log to pinned host "
                       f"{r['log']:.2f} ms a tensor ({r['log'] / r['split.F']:.3f} of F)")
        # bf16 sums in another order differ by a few units of its last place (2^-8 of the largest gradient)
        ok = r["max_rel_grad_diff"] <= 2.0**-6
        out.append(Row("b", setting, result_text, "ok" if ok else "FAILED: split gradients differ from fused"))
    return out


# ---------------------------------------------------------------------------------------------- (c) NCCL
def _nccl_part(dry: bool, rounds: int = 5) -> dict[str, Any]:
    """(c): the engine's own epoch groups on one rank (``NcclEpochComm``: p2p, norm and stage communicators), built,
    used and retired (aborted together) ``rounds`` times (seconds each); then a receive nobody sends, which the
    polled wait gives up on once the detector says a member died, and the epoch's abort."""
    import torch
    import torch.distributed as dist

    from ds_recycle.resilience.errors import PeerFailure
    from ds_recycle.resilience.nccl import NcclEpochComm, polled_wait
    from ds_recycle.resilience.transport import EpochComm

    store = dist.HashStore()
    device = torch.device("cpu" if dry else "cuda:0")

    class Detector:  # the worker's failure detector, as a wait sees it: "a member died" from ``at`` on
        def __init__(self, at: float = float("inf")) -> None:
            self.at = at

        def failed(self) -> bool:
            return time.monotonic() >= self.at

        def tripped(self) -> bool:
            return self.failed()

        def reason(self) -> str:
            return "a member died (the check's detector)"

    def build(k: int, detector: Detector) -> EpochComm:
        if dry:
            return EpochComm.build(store, k, [0], [0], 0, 30.0, detector, f"r{k}")
        return NcclEpochComm.build_nccl(store, k, [0], [0], 0, 30.0, detector, device, f"r{k}")

    def sync() -> None:
        if not dry:
            torch.cuda.synchronize()

    builds, aborts = [], []
    for k in range(rounds):
        start = time.perf_counter()
        comm = build(k, Detector())
        x = torch.full((4,), float(k + 1), device=device)
        comm.wait(comm.norm.all_reduce_sum(x), "all-reduce")
        sync()
        builds.append(time.perf_counter() - start)
        if float(x.sum()) != 4.0 * (k + 1):
            raise RuntimeError(f"all-reduce on one rank gave {x.tolist()}")
        start = time.perf_counter()
        comm.retire()
        sync()
        aborts.append(time.perf_counter() - start)
    out: dict[str, Any] = {"builds_s": builds, "aborts_s": aborts, "communicators": len(comm.groups)}
    if dry:
        return out
    detector = Detector(time.monotonic() + 1.0)
    comm = build(rounds, detector)
    buf = torch.empty(1 << 20, device=device)
    work = comm.p2p.recv(buf, 0)  # from itself, never sent: NCCL spins
    start = time.perf_counter()
    try:
        polled_wait(work, detector, "a receive nobody sends", timeout_s=30.0)
        out["unmatched_gave_up_s"] = None
    except PeerFailure:
        out["unmatched_gave_up_s"] = time.perf_counter() - start
    start = time.perf_counter()
    comm.retire()
    torch.cuda.synchronize()
    out["unmatched_abort_s"] = time.perf_counter() - start
    y = torch.arange(8.0, device=device) * 2
    out["healthy_after"] = float(y.sum()) == 56.0
    return out


def _nccl_rows(result: dict[str, Any], dry: bool) -> list[Row]:
    backend = "gloo, CPU (dry run)" if dry else "NCCL, cuda:0"
    b, a = result["builds_s"], result["aborts_s"]
    retired = "left behind, as gloo's are" if dry else "aborted together"
    rows = [Row("c", f"one rank, {backend}: an epoch's {result['communicators']} groups built + all-reduce, retired "
                     f"({retired}), x{len(b)}",
                f"build {b[0]:.3f} s first, {statistics.median(b[1:]):.3f} s median after; retire median "
                f"{statistics.median(a):.3f} s", "ok")]
    if dry:
        rows.append(Row("c", "one rank: a receive nobody sends, aborted", "-",
                        "not run: gloo's abort cannot release a pending receive (NCCL only)"))
    else:
        healthy, gave_up = result["healthy_after"], result["unmatched_gave_up_s"]
        ok = healthy and gave_up is not None
        waited = "never" if gave_up is None else f"after {gave_up:.3f} s"
        rows.append(Row("c", "one rank, NCCL: a receive nobody sends, a member declared dead after 1 s, the epoch "
                             "retired", f"the wait gave up {waited}; abort + synchronize "
                             f"{result['unmatched_abort_s']:.3f} s; CUDA healthy after: {healthy}",
                        "ok" if ok else "FAILED: the wait did not end, or CUDA is unusable after the abort"))
    return rows


# ---------------------------------------------------------------------------------------------- driver
_PARTS: dict[str, Callable[..., Any]] = {"a": _job_part, "b": _split_part, "c": _nccl_part, "d": _nccl_job_part}


def _run_part(part: str, dry: bool, repeats: int, env: dict[str, str], work: Path | None) -> tuple[Any, str | None]:
    """The part's JSON result from a subprocess, or (None, why it failed)."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--part", part, "--repeats", str(repeats)]
    argv += ["--dry-run"] if dry else []
    argv += ["--work", str(work)] if work is not None else []
    limit = PART_TIMEOUT_S[part]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=limit, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None, f"FAILED: no answer within {limit:.0f} s (a hang)"
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return None, f"FAILED: exit {done.returncode}: {' | '.join(tail)}"
    return json.loads(lines[-1][len("RESULT "):]), None


def _install_wheels(folder: Path) -> str:
    """Install every wheel of ``folder`` into a fresh target directory; returns it (for PYTHONPATH)."""
    wheels = sorted(str(p) for p in folder.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"gpu_check: --wheels {folder}: no .whl file there")
    target = tempfile.mkdtemp(prefix="gpu_check_site_")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", target, *wheels], check=True)
    return target


def check(dry: bool, repeats: int, wheels: Path | None, parts: str = "abcd", work: Path | None = None) -> list[Row]:
    env = {**os.environ, **_NCCL_ENV, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *([_install_wheels(wheels)] if wheels else []), os.environ.get("PYTHONPATH", "")])}
    env.setdefault("OMP_NUM_THREADS", "1" if dry else "8")
    gpus = 0 if dry else _gpus()
    rows: list[Row] = []
    why_not = "no CUDA device" if not dry and gpus == 0 else None
    for part, to_rows in (("b", _split_rows), ("c", _nccl_rows), ("a", _job_rows)):  # the jobs last: the longest
        if part not in parts:
            continue
        if why_not is not None:
            rows.append(Row(part, "-", "-", f"not run: {why_not}"))
            continue
        began = time.perf_counter()
        result, failure = _run_part(part, dry, repeats, env, work)
        new = to_rows(result, dry) if failure is None else [Row(part, "-", "-", failure)]
        print(f"({part}) {time.perf_counter() - began:.0f} s: " + "; ".join(f"{r.result} [{r.status}]" for r in new),
              file=sys.stderr, flush=True)
        rows += new
    if "d" in parts:
        if dry or gpus < 2:
            rows.append(Row("d", "NCCL, one GPU per worker, a worker killed from outside", "-",
                            "not run: needs two GPUs" + (" (dry run)" if dry else f" ({gpus} here)")))
        else:
            result, failure = _run_part("d", dry, repeats, env, work)
            rows += _nccl_job_rows(result, dry) if failure is None else [Row("d", "-", "-", failure)]
    return rows


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def table(rows: list[Row]) -> str:
    width = {f: max(len(f), *(len(getattr(r, f)) for r in rows)) for f in ("part", "setting", "result")}
    lines = [f"{'part':<{width['part']}}  {'setting':<{width['setting']}}  {'result':<{width['result']}}  status"]
    lines += [f"{r.part:<{width['part']}}  {r.setting:<{width['setting']}}  {r.result:<{width['result']}}  {r.status}"
              for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="on CPU at a tiny size (what CI runs)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats of (b), alternated (default 5)")
    p.add_argument("--wheels", type=Path, default=None, help="install these wheels for the parts first")
    p.add_argument("--out", type=Path, default=None, help="also write the table here")
    p.add_argument("--parts", default="abcd", help="which parts to run, e.g. 'bc' (default abcd: all)")
    p.add_argument("--work", type=Path, default=None, help="keep (a)'s configs, logs and final models here")
    p.add_argument("--part", choices=sorted(_PARTS), default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.parts or set(args.parts) - set("abcd"):
        p.error(f"--parts {args.parts!r}: give letters among a, b, c and d")
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: give 1 or more")
    if args.part is not None:  # one part, in the subprocess the driver started
        sys.path.insert(0, str(ROOT))
        kwargs: dict[str, Any] = {"b": {"repeats": args.repeats}, "a": {"work": args.work},
                                    "d": {"work": args.work}}.get(args.part, {})
        print("RESULT " + json.dumps(_PARTS[args.part](args.dry_run, **kwargs)), flush=True)
        return 0
    began = time.perf_counter()
    rows = check(args.dry_run, args.repeats, args.wheels, args.parts, args.work)
    head = (f"gpu_check{' --dry-run (CPU)' if args.dry_run else ''}: {platform.node()}, {platform.machine()}, "
            f"python {platform.python_version()}; {time.perf_counter() - began:.0f} s")
    text = head + "\n" + table(rows)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 1 if any(r.failed for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
