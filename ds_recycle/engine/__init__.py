"""The ReCycle engine inside DeepSpeed: plans executed by a ``PipelineEngine`` subclass.

- :mod:`~ds_recycle.engine.instructions`: the instruction set (B, W, staggered step, explicit-peer comm);
- :mod:`~ds_recycle.engine.schedule`: a worker's plan ops lowered to DeepSpeed steps (``PlanSchedule``);
- :mod:`~ds_recycle.engine.engine`: ``RecyclePipelineEngine`` and its handlers;
- :mod:`~ds_recycle.engine.backward`: the B/W split; :mod:`~ds_recycle.engine.optimizer`: the staggered step;
- :mod:`~ds_recycle.engine.p2p`: tagged explicit-peer transfers; :mod:`~ds_recycle.engine.state`: the whole
  model's parameters gathered on one rank.

``ds_recycle.initialize`` (:mod:`ds_recycle.api`) builds the engine from a user's ``PipelineModule``.

Submodules import torch and DeepSpeed; import them directly.
"""
from __future__ import annotations

__all__: list[str] = []
