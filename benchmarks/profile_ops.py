"""Per-stage costs of the GPT for the planner: F, B, W, O and p2p, measured on this machine.

    PYTHONPATH=. python benchmarks/profile_ops.py --deepspeed_config configs/gpt_cpu_2x2.json \
        --out runs/costs_gpt_cpu_2x2.json [--repeats 20]

Each stage's layers are built exactly as DeepSpeed partitions them (``type:Block``) and timed in this
process with one thread (median of ``--repeats`` after warm-up, in process CPU time, which a machine shared
with other jobs does not inflate), through the engine's own code paths:

- F: the stage forward with the engine's owner-module capture (plus the loss on the last stage);
- B: :func:`ds_recycle.engine.backward.backward_input` (input gradients only);
- W: the per-module weight-gradient passes B left behind;
- fused: DeepSpeed's single ``backward`` of the stage (for the B + W overhead figure);
- O: the optimizer step (Adam/AdamW/SGD from the config) over the stage's parameters (nothing is copied:
  the step waits for the clipping norm instead of being redone); the gradient all-reduce is not measured here;
- comm: one activation sent between two gloo processes on this host (half a round trip).

Writes the planner's cost-profile file (``F, B, W, O`` lists and ``comm``, in milliseconds, plus extra keys
that readers ignore) and prints a table with the B + W over fused-backward ratio per stage: the median of
per-repeat ratios (B + W and fused run interleaved) and the best case (fastest B + W over fastest fused).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


DEVICE = torch.device("cpu")


def _clock() -> float:
    """CPU: process CPU time (with one compute thread it is the op's compute time, and it does not count the
    time other processes of a shared machine hold the cores). CUDA: wall time after a device synchronize."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time()


def _median_ms(fn: Callable[[], None], repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = _clock()
        fn()
        times.append((_clock() - t0) * 1e3)
    return statistics.median(times)


def stage_layers(cfg, stages: int) -> list[list]:  # type: ignore[no-untyped-def]
    """The LayerSpecs of each stage, partitioned as DeepSpeed's ``type:Block`` does."""
    from deepspeed.runtime import utils as ds_utils

    from ds_recycle.model import Block, gpt_layer_specs

    specs = gpt_layer_specs(cfg)
    weights = [1 if spec.typename is Block else 0 for spec in specs]
    parts = ds_utils.partition_balanced(weights=weights, num_parts=stages)
    return [specs[parts[s]:parts[s + 1]] for s in range(stages)]


def profile_stage(stage: int, stages: int, tcfg, repeats: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    from ds_recycle.engine.backward import OwnerCapture, backward_input
    from ds_recycle.model import gpt_loss_fn
    from ds_recycle.train.optim import build_optimizer

    mcfg = tcfg.recycle.model
    torch.manual_seed(stage)
    module = torch.nn.Sequential(*[spec.build() for spec in stage_layers(mcfg, stages)[stage]]).to(DEVICE)
    capture = OwnerCapture(module)
    mbs, t, d = tcfg.micro_batch_size, mcfg.seq_len, mcfg.d_model
    tokens = torch.randint(0, mcfg.vocab_size, (mbs, t), device=DEVICE)
    first, last = stage == 0, stage == stages - 1
    grad_out = None if last else torch.randn(mbs, t, d, device=DEVICE)

    def forward() -> tuple[torch.Tensor, object, torch.Tensor | None]:
        x = tokens if first else torch.randn(mbs, t, d, device=DEVICE).requires_grad_(True)
        with capture.capture() as cap:
            out = module(x)
            if last:
                out = gpt_loss_fn(out, tokens) / tcfg.micro_batches
        return out, cap, None if first else x

    def fused() -> float:
        out, _, _ = forward()
        t0 = _clock()
        out.backward(grad_out)
        return (_clock() - t0) * 1e3

    def split() -> tuple[float, float]:
        out, cap, x = forward()
        t0 = _clock()
        _, work = backward_input(out, grad_out, x, cap, capture)
        t1 = _clock()
        work.run()
        return (t1 - t0) * 1e3, (_clock() - t1) * 1e3

    f = _median_ms(lambda: forward(), repeats)
    for _ in range(3):
        fused(), split()
    fused_ms, bw = [], []
    for _ in range(repeats):  # interleaved, so both see the same machine load
        module.zero_grad(set_to_none=True)
        fused_ms.append(fused())
        module.zero_grad(set_to_none=True)
        bw.append(split())
    optimizer = build_optimizer(tcfg, module.parameters())
    for p in module.parameters():
        p.grad = torch.randn_like(p)

    o = _median_ms(optimizer.step, repeats)
    return {"F": f, "B": statistics.median(b for b, _ in bw), "W": statistics.median(w for _, w in bw),
            "fused_backward": statistics.median(fused_ms), "O": o,
            "bw_over_fused": statistics.median((b + w) / fu for (b, w), fu in zip(bw, fused_ms)),
            "bw_over_fused_best": min(b + w for b, w in bw) / min(fused_ms),
            "params": float(sum(p.numel() for p in module.parameters()))}


def _pingpong(rank: int, port: int, numel: int, repeats: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buf = torch.randn(numel)
    times = []
    for i in range(repeats + 3):
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3 / 2)
    if rank == 0:
        Path(out).write_text(json.dumps(statistics.median(times)))
    dist.barrier()
    dist.destroy_process_group()


def measure_comm(numel: int, repeats: int) -> float:
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "comm.json")
        mp.spawn(_pingpong, args=(port, numel, repeats, out), nprocs=2, join=True)
        return float(json.loads(Path(out).read_text()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deepspeed_config", required=True)
    p.add_argument("--out", required=True, help="cost-profile JSON to write (the planner's --costs-file)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where to time F, B, W and O (auto: CUDA when present); comm is always gloo between "
                        "two processes of this host")
    args = p.parse_args(argv)
    global DEVICE
    DEVICE = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    torch.set_num_threads(1)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from ds_recycle.config import load_config

    cfg = load_config(args.deepspeed_config)
    stages = cfg.recycle.stages
    rows = [profile_stage(s, stages, cfg, args.repeats) for s in range(stages)]
    m = cfg.recycle.model
    comm = measure_comm(cfg.micro_batch_size * m.seq_len * m.d_model, args.repeats)
    profile = {k: [round(r[k], 4) for r in rows] for k in ("F", "B", "W", "O")}
    profile.update({"comm": round(comm, 4), "units": "ms", "fused_backward": [round(r["fused_backward"], 4) for r in rows],
                    "bw_over_fused": [round(r["bw_over_fused"], 4) for r in rows],
                    "bw_over_fused_best": [round(r["bw_over_fused_best"], 4) for r in rows],
                    "device": (torch.cuda.get_device_name() if DEVICE.type == "cuda" else
                               f"cpu ({platform.processor() or platform.machine()}, 1 thread)") + f", torch {torch.__version__}",
                    "config": args.deepspeed_config, "command": " ".join(["python", *sys.argv])})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(profile, indent=2))
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    print(f"command: {' '.join(['python', *sys.argv])}")
    print(f"{'stage':>5} {'params':>9} {'F ms':>8} {'B ms':>8} {'W ms':>8} {'fused ms':>9} {'(B+W)/fused':>12} "
          f"{'best-case':>10} {'O ms':>7}")
    for s, r in enumerate(rows):
        print(f"{s:>5} {int(r['params']):>9} {r['F']:>8.2f} {r['B']:>8.2f} {r['W']:>8.2f} {r['fused_backward']:>9.2f} "
              f"{r['bw_over_fused']:>12.3f} {r['bw_over_fused_best']:>10.3f} {r['O']:>7.2f}")
    print(f"comm (one activation, {cfg.micro_batch_size}x{m.seq_len}x{m.d_model} fp32): {comm:.3f} ms")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
