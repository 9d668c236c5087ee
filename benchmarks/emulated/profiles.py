"""Cost profiles for emulated accelerators: per-stage F, B, W of real models on real accelerators, scaled.

A profile is the planner's cost-profile file (``F``, ``B``, ``W``, ``O`` lists and ``comm``, milliseconds; see
:class:`ds_recycle.plan.CostModel`) plus ``source`` and ``scale`` keys that readers ignore. The emulated
layers sleep ``F``, ``B`` and ``W``; ``O`` and ``comm`` are 0 in the profile because the optimizer step, the
all-reduce and the transfers run for real (their measured times go into the fed-back costs file instead).

Where the numbers come from (:func:`ds_recycle.cluster.models.stage_costs`, every figure cited there):

- ``gpt3-2.7b`` and ``gpt3-6.7b``: GPT-3 shapes of "Language Models are Few-Shot Learners" (arXiv 2005.14165,
  Table 2.1), sequences of 2048 tokens, one sequence a micro-batch, split into contiguous stages of one
  8 x A100-80GB node each (tensor parallel inside the node);
- per layer F = 24bsh^2 + 4bs^2h, B = 24bsh^2 + 8bs^2h, W = 24bsh^2 FLOP (Megatron-LM's count, arXiv 2104.04473,
  section 5.1, split into input- and weight-gradient halves as in "Zero Bubble Pipeline Parallelism",
  arXiv 2401.10241, whose profiles also have W cheaper than B), plus the language-model head on the last stage;
- FLOP to time at 45% of the A100's 312 TFLOP/s bf16 peak (Megatron-LM reaches 44-52% at scale, arXiv
  2104.04473, Table 1).

On an A100 node these are milliseconds (GPT-3 2.7B on 4 stages: F 2.9 ms, B 3.3 ms, W 2.6 ms a stage); the
profile multiplies every value by one factor so that the slowest stage's F is ``f_ms`` (100 ms by default),
which keeps the ratios between F, B, W and between stages, and makes a sleep long against the runtime's
per-operation CPU cost on a 2-core machine. Communication is not scaled: it is this machine's real transport.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ds_recycle.cluster.models import A100_NODE, get_model, stage_costs

__all__ = ["PROFILES", "profile", "write_profile"]

PROFILES = ("gpt3-2.7b", "gpt3-6.7b")


def profile(name: str, stages: int, pipelines: int, f_ms: float = 100.0) -> dict[str, Any]:
    """The scaled profile of model ``name`` on ``stages`` A100 nodes a pipeline (see the module docstring)."""
    if name not in PROFILES:
        raise ValueError(f"profile {name!r} is unknown. Fix: one of {', '.join(PROFILES)}")
    if not f_ms > 0:
        raise ValueError(f"f_ms = {f_ms}: the slowest stage's emulated forward must be > 0 ms")
    real = stage_costs(get_model(name), A100_NODE, stages, pipelines, 1)
    scale = f_ms / (max(real.F) * 1e3)
    out: dict[str, Any] = {kind: [round(v * 1e3 * scale, 3) for v in getattr(real, kind)] for kind in ("F", "B", "W")}
    out.update(O=[0.0] * stages, comm=0.0, scale=scale,
               source=f"{name}, {stages} stages of one {A100_NODE.name} node, micro-batch 1 x 2048 tokens "
                      f"(ds_recycle.cluster.models.stage_costs); A100 times x {scale:.2f}",
               a100_ms={kind: [round(v * 1e3, 4) for v in getattr(real, kind)] for kind in ("F", "B", "W")})
    return out


def write_profile(path: Path, data: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path
