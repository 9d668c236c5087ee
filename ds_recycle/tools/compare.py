"""``ds-recycle compare A B``: are two final-parameter files the same model?

    ds-recycle compare runs/vanilla.pt runs/recycle.pt --rtol 1e-5

Both files are ``--save-final`` outputs of ``launch/train.py``: dicts from parameter name to tensor.
For each tensor it reports the largest absolute difference ``max|a - b|`` and the relative
difference ``max|a - b| / max|b|`` (relative to the tensor's own scale, so a single element near
zero cannot make it explode). Two files match when every tensor satisfies
``max|a - b| <= atol + rtol * max|b|`` and both hold the same names and shapes. Exit status 0 only
when they match; 1 when they differ; 2 when a file cannot be read or is not a torch save of tensors.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["TensorDiff", "add_arguments", "compare_state_dicts", "run"]


@dataclass(frozen=True)
class TensorDiff:
    """How far one tensor of A is from the same-named tensor of B."""

    name: str
    max_abs: float
    max_rel: float
    ok: bool
    problem: str = ""


def compare_state_dicts(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float,
                        atol: float = 0.0) -> list[TensorDiff]:
    """One :class:`TensorDiff` per name in either dict, in A's order then B's extras."""
    diffs = []
    for name in list(a) + [n for n in b if n not in a]:
        if name not in a or name not in b:
            where = "A" if name not in a else "B"
            diffs.append(TensorDiff(name, float("inf"), float("inf"), False, f"missing in {where}"))
            continue
        x, y = a[name].detach().double(), b[name].detach().double()
        if x.shape != y.shape:
            diffs.append(TensorDiff(name, float("inf"), float("inf"), False,
                                    f"shape {tuple(x.shape)} vs {tuple(y.shape)}"))
            continue
        max_abs = (x - y).abs().max().item() if x.numel() else 0.0
        scale = y.abs().max().item() if y.numel() else 0.0
        max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
        diffs.append(TensorDiff(name, max_abs, max_rel, max_abs <= atol + rtol * scale))
    return diffs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", help="first --save-final file")
    parser.add_argument("b", help="second --save-final file (the reference for relative differences)")
    parser.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance (default 1e-5)")
    parser.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0)")
    parser.add_argument("--all", action="store_true", help="list every tensor, not only the worst and failures")


def _load(path: str) -> dict[str, torch.Tensor]:
    if not Path(path).is_file():
        raise ValueError(f"no file at {path}: pass a file written by train.py --save-final")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises pickle, zip and EOF errors of many kinds: one line is enough
        raise ValueError(f"{path} is not a torch save file ({type(e).__name__}): pass a file written by "
                         "train.py --save-final") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path} is not a dict of tensors: pass a file written by train.py --save-final")
    return state


def run(args: argparse.Namespace) -> int:
    if args.rtol < 0 or args.atol < 0:
        print(f"error: --rtol {args.rtol} / --atol {args.atol}: tolerances must be >= 0")
        return 2
    try:
        a, b = _load(args.a), _load(args.b)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"error: {e}")
        return 2
    diffs = compare_state_dicts(a, b, args.rtol, args.atol)
    bad = [d for d in diffs if not d.ok]
    shown = diffs if args.all else sorted(diffs, key=lambda d: -d.max_rel)[:5] + [d for d in bad[5:]]
    print(f"{'tensor':<40} {'max abs diff':>14} {'max rel diff':>14}  status")
    for d in shown:
        print(f"{d.name:<40} {d.max_abs:>14.3e} {d.max_rel:>14.3e}  {'ok' if d.ok else 'DIFFERS ' + d.problem}")
    worst = max(diffs, key=lambda d: d.max_rel) if diffs else None
    verdict = "MATCH" if not bad else f"DIFFER ({len(bad)} of {len(diffs)} tensors)"
    print(f"{verdict}: {len(diffs)} tensors, rtol {args.rtol:g}, atol {args.atol:g}"
          + (f", worst {worst.name} rel {worst.max_rel:.3e}" if worst else ""))
    return 0 if not bad and diffs else 1
