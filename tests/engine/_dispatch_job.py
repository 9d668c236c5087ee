"""Single-process engine check (1 stage x 1 pipeline): prints a JSON report for test_dispatch.py.

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/engine/_dispatch_job.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    from deepspeed.runtime.pipe.schedule import PipeInstruction, PipeSchedule
    from plans import one_f_one_b

    import ds_recycle
    from ds_recycle.config import load_config
    from ds_recycle.config._strict import to_jsonable
    from ds_recycle.data import MicroBatchSource
    from ds_recycle.engine import instructions as ins
    from ds_recycle.engine.engine import RecyclePipelineEngine
    from ds_recycle.model import build_pipeline_module
    from ds_recycle.resilience.world import init_worker
    from ds_recycle.train.optim import build_optimizer

    cfg = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                       "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                       "recycle": {"stages": 1, "pipelines": 1,
                                   "model": {"n_layer": 1, "d_model": 32, "n_head": 2, "seq_len": 16}}})
    init_worker()
    called: list[str] = []

    class Spy(RecyclePipelineEngine):
        """Overrides one handler; only the re-declared map makes DeepSpeed's dispatch call it."""

        def _exec_backward_weight(self, buffer_id: int, micro_batch: tuple[int, int]) -> None:
            called.append(f"W{micro_batch}")
            super()._exec_backward_weight(buffer_id, micro_batch)

        _INSTRUCTION_MAP = {**RecyclePipelineEngine._INSTRUCTION_MAP, ins.BackwardWeight: _exec_backward_weight}

    module = build_pipeline_module(cfg.recycle.model, 1)
    engine, *_ = ds_recycle.initialize(model=module, config={**cfg.deepspeed, "recycle": to_jsonable(cfg.recycle)},
                                       training_data=MicroBatchSource(cfg), plan=one_f_one_b(1, 1, 2),
                                       optimizer=build_optimizer(cfg, module.parameters()))
    engine.enable_op_timing()
    engine.__class__ = Spy
    loss = engine.train_batch()
    report = {"executed": sorted(engine.op_seconds), "spy": list(called), "loss": float(loss)}

    class Unknown(PipeInstruction):
        pass

    class OneStep(PipeSchedule):
        def steps(self):  # type: ignore[no-untyped-def]
            yield [Unknown()]

    try:
        engine._exec_schedule(OneStep(1, 1, 0))
    except RuntimeError as e:
        report["unknown_error"] = str(e)
    from ds_recycle.engine.optimizer import ClipScope

    engine.stepper.scope, engine.stepper.counts = ClipScope.WHOLE_MODEL, True  # the all-reduced norm path
    engine.train_batch()
    outcome = engine.finish()
    report["whole_model_norm"] = None if outcome is None else outcome.norm
    report["steps"] = engine.global_steps
    print("REPORT " + json.dumps(report))
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
