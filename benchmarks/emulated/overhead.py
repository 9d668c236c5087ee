"""Where the runtime's CPU goes per operation: cProfiles of ``train.py --cprofile DIR``, by component.

    .venv/bin/python benchmarks/emulated/overhead.py DIR --ops-per-rank 24 --iterations 5

Reads every ``rank*.prof`` of ``DIR`` (main-thread CPU time per function, ``time.thread_time``), attributes
each function's own time to a component by its file (ds_recycle's engine dispatch, its transport, its
failure handling, DeepSpeed, torch.distributed, autograd and modules, the rest), and prints milliseconds of
CPU per compute operation (F, B or W) for each. Background threads (heartbeats, watchdogs) are not in a
main-thread profile: compare the total with the process CPU time per operation the benchmark prints.
Profiling itself slows Python code, so read the split, not the absolute numbers.
"""
from __future__ import annotations

import argparse
import pstats
import sys
from pathlib import Path

COMPONENTS = (
    ("ds_recycle engine (dispatch, schedule, B/W split, optimizer)", ("ds_recycle/engine/",)),
    ("ds_recycle transport and comm", ("ds_recycle/resilience/transport", "ds_recycle/resilience/comm",
                                       "ds_recycle/resilience/detached")),
    ("ds_recycle failure handling (watchdog, heartbeats, snapshots, runner)", ("ds_recycle/resilience/",)),
    ("ds_recycle other", ("ds_recycle/",)),
    ("DeepSpeed", ("deepspeed/",)),
    ("torch.distributed (gloo calls)", ("torch/distributed/",)),
    ("torch autograd, modules, optimizer", ("torch/",)),
    ("emulated layers", ("benchmarks/emulated/",)),
)


def component(filename: str, name: str) -> str:
    for label, parts in COMPONENTS:
        if any(p in filename for p in parts):
            return label
    if filename == "~":
        return "C calls from Python (autograd engine, c10d, tensor methods; see the functions below)"
    return "other Python (threading, copy, stdlib)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir")
    p.add_argument("--ops-per-rank", type=float, required=True, help="F + B + W operations a rank runs an iteration")
    p.add_argument("--iterations", type=int, required=True, help="timed iterations in the profiles")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--process-cpu-ms", type=float, default=None,
                   help="the benchmark's process CPU per operation, to print the share outside the main thread")
    args = p.parse_args()
    files = sorted(Path(args.dir).glob("rank*.prof"))
    if not files:
        print(f"no rank*.prof in {args.dir}: run train.py with --cprofile {args.dir}", file=sys.stderr)
        return 2
    by_comp: dict[str, float] = {}
    by_func: dict[str, float] = {}
    for f in files:
        stats = pstats.Stats(str(f)).stats  # type: ignore[attr-defined]
        for (filename, line, name), (_, _, tottime, _, _) in stats.items():
            label = component(filename, name)
            by_comp[label] = by_comp.get(label, 0.0) + tottime
            key = f"{Path(filename).name}:{line} {name}"
            by_func[key] = by_func.get(key, 0.0) + tottime
    ops = len(files) * args.iterations * args.ops_per_rank
    total = sum(by_comp.values())
    print(f"{len(files)} ranks, {args.iterations} iterations, {args.ops_per_rank:g} ops a rank an iteration: "
          f"main-thread CPU {1e3 * total / ops:.2f} ms per operation")
    if args.process_cpu_ms:
        main_ms = 1e3 * total / ops
        print(f"process CPU {args.process_cpu_ms:.2f} ms per operation: {args.process_cpu_ms - main_ms:.2f} ms "
              f"({100 * (1 - main_ms / args.process_cpu_ms):.0f}%) outside the main thread (gloo, waits, heartbeats)")
    for label, t in sorted(by_comp.items(), key=lambda kv: -kv[1]):
        print(f"  {1e3 * t / ops:7.3f} ms/op  {100 * t / total:5.1f}%  {label}")
    print("top functions (own time):")
    for key, t in sorted(by_func.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {1e3 * t / ops:7.3f} ms/op  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
