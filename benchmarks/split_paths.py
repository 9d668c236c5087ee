"""What the B/W split costs per W path, against one fused backward and against another revision's split.

    PYTHONPATH=. python benchmarks/split_paths.py [--against REV] [--repeats 30] [--out FILE]

Stages timed in this process with one thread (process CPU time, median over ``--repeats``; every variant of a
repeat runs back to back, alternated, so all see the same machine load):

- ``gpt-first`` / ``gpt-last``: the default job's two stages (``configs/gpt_cpu_2x2.json``, partitioned as
  DeepSpeed's ``type:Block``);
- ``nested``: four ViT-style blocks whose modules own parameters beside their children (an input scale used before
  the block's first ``Linear``, layer scales after its branches);
- ``tied-read``: two such blocks and a head that reads an embedding's weight outside the embedding's call (as
  ``TiedLayerSpec``'s ``forward_fn`` does): that weight starts at the stage output.

Columns: fused backward; B and W of this checkout's split (and the share of B spent in the graph sweep that picks
the paths); B + W over fused; the paths taken (passes from marked edges, parameters in the pass from the stage output); and, with
``--against``, B + W of that revision's ``ds_recycle/engine/backward.py`` (``fails`` where it raises).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.byom.models import ScaledBlock  # noqa: E402  (the ViT block whose modules own parameters beside children)


def _gpt_stage(stage: int) -> tuple[nn.Module, Callable[[], tuple[Any, Any]], Any]:
    """The default job's stage ``stage`` (of 2), its input maker and its output gradient (None: the loss)."""
    from benchmarks.profile_ops import stage_layers
    from ds_recycle.config import load_config
    from ds_recycle.model import gpt_loss_fn

    cfg = load_config(str(ROOT / "configs" / "gpt_cpu_2x2.json"))
    m = cfg.recycle.model
    torch.manual_seed(stage)
    module = nn.Sequential(*[spec.build() for spec in stage_layers(m, 2)[stage]])
    tokens = torch.randint(0, m.vocab_size, (cfg.micro_batch_size, m.seq_len))
    if stage == 0:
        return module, lambda: (tokens, None), torch.randn(cfg.micro_batch_size, m.seq_len, m.d_model)

    class _WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = module

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return gpt_loss_fn(self.body(x), tokens) / cfg.micro_batches

    def inputs() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(cfg.micro_batch_size, m.seq_len, m.d_model).requires_grad_(True)
        return x, x
    return _WithLoss(), inputs, None


def _tied_read() -> tuple[nn.Module, Callable[[], tuple[Any, Any]], Any]:
    width, vocab, t, b = 128, 512, 64, 4

    class _Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*[ScaledBlock(width, 4) for _ in range(2)])
            self.embed = nn.Embedding(vocab, width)
            self.tokens = torch.randint(0, vocab, (b, t))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            logits = self.blocks(x) @ self.embed.weight.t()  # the head reads the embedding's weight
            return F.cross_entropy(logits.reshape(-1, vocab), self.tokens.reshape(-1))

    def inputs() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(b, t, width).requires_grad_(True)
        return x, x
    return _Tied(), inputs, None


def _nested() -> tuple[nn.Module, Callable[[], tuple[Any, Any]], Any]:
    width, t, b = 128, 64, 4
    torch.manual_seed(0)
    module = nn.Sequential(*[ScaledBlock(width, 4) for _ in range(4)])

    def inputs() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(b, t, width).requires_grad_(True)
        return x, x
    return module, inputs, torch.randn(b, t, width)


CASES: dict[str, Callable[[], tuple[nn.Module, Callable[[], tuple[Any, Any]], Any]]] = {
    "gpt-first": lambda: _gpt_stage(0), "gpt-last": lambda: _gpt_stage(1), "nested": _nested,
    "tied-read": _tied_read}


def _load_backward(rev: str) -> ModuleType:
    """``ds_recycle/engine/backward.py`` as it is at git revision ``rev``, as a module of its own."""
    source = subprocess.run(["git", "show", f"{rev}:ds_recycle/engine/backward.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "backward_at_rev.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("backward_at_rev", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _time_case(name: str, repeats: int, other: ModuleType | None) -> dict[str, Any]:
    from ds_recycle.engine import autograd_graph, backward

    module, inputs, grad = CASES[name]()
    sweep_s: list[float] = []
    real_cuts = autograd_graph.dominators

    def timed_cuts(*args: Any) -> Any:
        t0 = time.process_time()
        try:
            return real_cuts(*args)
        finally:
            sweep_s.append(time.process_time() - t0)
    backward.dominators = timed_cuts  # type: ignore[attr-defined]
    mine = backward.OwnerCapture(module)
    theirs = other.OwnerCapture(module) if other is not None else None  # both hooks fire; each records when active

    def fused() -> float:
        x, stage_input = inputs()
        out = module(x)
        t0 = time.process_time()
        out.backward(grad)
        return time.process_time() - t0

    def split(lib: ModuleType, capture: Any) -> tuple[float, float, Any]:
        x, stage_input = inputs()
        with capture.capture() as cap:
            out = module(x)
        t0 = time.process_time()
        _, work = lib.backward_input(out, grad, stage_input, cap, capture)
        kinds = work.kinds() if hasattr(work, "kinds") else None
        if hasattr(cap, "outputs"):  # that revision's engine broke the hooks' reference cycle after B
            cap.outputs.clear()
        t1 = time.process_time()
        work.run()
        return t1 - t0, time.process_time() - t1, kinds

    rows: dict[str, list[float]] = {"fused": [], "B": [], "W": [], "sweep": [], "theirs": []}
    kinds: tuple[int, int] | None = None
    theirs_fail = ""
    for i in range(repeats + 3):
        sample: dict[str, float] = {"theirs": float("nan")}
        variants = ["fused", "mine", "theirs"]
        for variant in variants[i % 3:] + variants[:i % 3]:  # rotated: each runs first, second and third in turn
            module.zero_grad(set_to_none=True)
            if variant == "fused":
                sample["fused"] = fused()
            elif variant == "mine":
                sweep_s.clear()
                sample["B"], sample["W"], kinds = split(backward, mine)
                sample["sweep"] = sum(sweep_s)
            elif theirs is not None and other is not None and not theirs_fail:
                try:
                    tb, tw, _ = split(other, theirs)
                    sample["theirs"] = tb + tw
                except RuntimeError as e:
                    theirs_fail = str(e).split("\n")[0][:60]
        if i >= 3:
            for key in rows:
                rows[key].append(sample[key] * 1e3)
    backward.dominators = real_cuts  # type: ignore[attr-defined]
    med = {k: statistics.median(v) if v and all(x == x for x in v) else float("nan") for k, v in rows.items()}
    return {**med, "ratio": statistics.median((b + w) / f for b, w, f in zip(rows["B"], rows["W"], rows["fused"])),
            "kinds": kinds, "theirs_fail": theirs_fail}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", default=None, help="a git revision whose backward.py to time alongside")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", default=None, help="also write the table here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    other = _load_backward(args.against) if args.against else None
    lines = [f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores, load "
             f"{os.getloadavg()[0]:.1f}, torch {torch.__version__}, 1 thread, process CPU time, median of "
             f"{args.repeats}",
             f"command: {' '.join(['python', *sys.argv])}",
             f"{'stage':>10} {'fused ms':>9} {'B ms':>8} {'W ms':>8} {'sweep ms':>9} {'(B+W)/fused':>12} "
             f"{'edge passes':>11} {'root params':>11}" + (f" {'B+W at ' + args.against:>16}" if other else "")]
    for name in CASES:
        r = _time_case(name, args.repeats, other)
        cell = ("fails: " + r["theirs_fail"]) if r["theirs_fail"] else f"{r['theirs']:.2f}"
        theirs = "" if other is None else f" {cell:>16}"
        lines.append(f"{name:>10} {r['fused']:>9.2f} {r['B']:>8.2f} {r['W']:>8.2f} {r['sweep']:>9.3f} "
                     f"{r['ratio']:>12.3f} {r['kinds'][0]:>11} {r['kinds'][1]:>11}{theirs}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
