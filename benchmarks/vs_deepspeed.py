"""Time per iteration of ds_recycle over vanilla DeepSpeed on the same GPT and data, measured side by side.

    PYTHONPATH=. python benchmarks/vs_deepspeed.py --deepspeed_config configs/gpt_cpu_2x2.json \
        [--steps 10] [--rounds 2] [--costs-file runs/costs.json]

Setups (each a real ``ds-recycle launch`` job of ``launch/train.py``; jobs of one setup alternate, round
after round, so machine load hits every engine alike):

- 2 stages x 1 pipeline (2 processes): vanilla DeepSpeed 1F1B, ds_recycle with the 1F1B plan, with the
  zero-bubble (ZB-H1) plan;
- 2 x 2 (4 processes): the same three;
- 2 x 2 with worker (pipeline 1, stage 0) absent (3 processes, the adaptive plan): measured time next to
  the planner's prediction from the measured cost profile (``--costs-file``, from
  ``benchmarks/profile_ops.py``; profiled now when not given) and next to the failure-free time.

Time per iteration is the reporter's steady-state wall time: ``(t_last - t_warm) / iterations`` after
``--warmup`` iterations. Ratios below 1 mean ds_recycle is faster.
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _variant_config(base: dict, tmp: Path, name: str, pipelines: int, schedule: str | None,
                    absent: list | None = None, costs_file: str | None = None) -> Path:
    cfg = json.loads(json.dumps(base))
    cfg.pop("train_batch_size", None)
    rc = cfg["recycle"]
    rc.update({"pipelines": pipelines, "enabled": schedule is not None})
    if schedule is not None:
        rc["schedule"] = schedule
    rc.pop("assume_failed", None)
    if absent:
        rc["assume_failed"] = absent
    if costs_file:
        rc["costs_file"] = costs_file
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return path


def _run(config: Path, nproc: int, steps: int, warmup: int, vanilla: bool, tmp: Path) -> float:
    metrics = tmp / f"{config.stem}.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "ds_recycle", "launch", "--num_accelerators", str(nproc), "--master_port", "0",
           str(REPO / "launch" / "train.py"), "--deepspeed_config", str(config), "--steps", str(steps),
           "--metrics", str(metrics)] + (["--vanilla"] if vanilla else [])
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return (recs[-1]["time_s"] - recs[warmup - 1]["time_s"]) / (len(recs) - warmup)


def _alternate(variants: list[tuple[str, Path, int, bool]], args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name, *_ in variants}
    for _ in range(args.rounds):
        for name, config, nproc, vanilla in variants:
            times[name].append(_run(config, nproc, args.steps, args.warmup, vanilla, tmp))
    for name, values in times.items():
        print(f"  {name:<15} rounds: {' '.join(f'{v:.3f}' for v in values)} s/iter", flush=True)
    return {name: statistics.median(v) for name, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deepspeed_config", default=str(REPO / "configs" / "gpt_cpu_2x2.json"))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--costs-file", default=None, help="cost profile from benchmarks/profile_ops.py")
    p.add_argument("--setups", nargs="+", choices=("2x1", "2x2", "absent"), default=["2x1", "2x2", "absent"])
    args = p.parse_args(argv)
    base = json.loads(Path(args.deepspeed_config).read_text())
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    print(f"command: {' '.join(['python', *sys.argv])}")
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        costs = args.costs_file or str(tmp / "costs.json")
        if not args.costs_file:
            subprocess.run([sys.executable, str(REPO / "benchmarks" / "profile_ops.py"), "--deepspeed_config",
                            args.deepspeed_config, "--out", costs], check=True, cwd=REPO,
                           env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, capture_output=True)
        results: dict[str, dict[str, float]] = {}
        for label, pipelines in (("2x1", 1), ("2x2", 2)):
            if label not in args.setups:
                continue
            variants = [("vanilla", _variant_config(base, tmp, f"v{pipelines}", pipelines, None), 2 * pipelines, True),
                        ("1f1b", _variant_config(base, tmp, f"a{pipelines}", pipelines, "1f1b"), 2 * pipelines, False),
                        ("zb-h1", _variant_config(base, tmp, f"z{pipelines}", pipelines, "zb-h1"), 2 * pipelines, False)]
            results[label] = _alternate(variants, args, tmp)
        if "absent" in args.setups:
            absent_cfg = _variant_config(base, tmp, "absent", 2, "adaptive", [[1, 0]], costs)
            free_cfg = _variant_config(base, tmp, "free", 2, "adaptive", None, costs)
            results["absent"] = _alternate([("failure-free", free_cfg, 4, False),
                                            ("absent (1,0)", absent_cfg, 3, False)], args, tmp)
        _report(results, costs, base, args)
    return 0


def _report(results: dict[str, dict[str, float]], costs_path: str, base: dict, args: argparse.Namespace) -> None:
    from ds_recycle.plan import CostModel, make_plan

    print("\nsetup  engine          s/iter   over vanilla")
    for label in ("2x1", "2x2"):
        if label not in results:
            continue
        r = results[label]
        for name in ("vanilla", "1f1b", "zb-h1"):
            print(f"{label:<6} {('ds_recycle ' + name) if name != 'vanilla' else 'DeepSpeed':<15} {r[name]:>7.3f}"
                  f"   {r[name] / r['vanilla']:>6.3f}")
    if "absent" not in results:
        return
    costs = CostModel.from_file(costs_path)
    stages, m = base["recycle"]["stages"], base["gradient_accumulation_steps"]
    free = make_plan(stages, 2, m, costs, (), schedule="adaptive").time_per_iteration / 1e3
    hole = make_plan(stages, 2, m, costs, [(1, 0)], schedule="adaptive").time_per_iteration / 1e3
    r = results["absent"]
    print("\n2x2 adaptive plan     measured s/iter   predicted s/iter   measured/predicted")
    print(f"failure-free          {r['failure-free']:>10.3f}   {free:>16.3f}   {r['failure-free'] / free:>10.3f}")
    print(f"absent (1, 0)         {r['absent (1,0)']:>10.3f}   {hole:>16.3f}   {r['absent (1,0)'] / hole:>10.3f}")
    print(f"slowdown of the failure: measured {r['absent (1,0)'] / r['failure-free']:.3f}, "
          f"predicted {hole / free:.3f}")
    print(f"(steps {args.steps}, warm-up {args.warmup}, rounds {args.rounds}; costs from {costs_path})")


if __name__ == "__main__":
    sys.exit(main())
