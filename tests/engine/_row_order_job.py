"""One-process check of own-row accumulation order (run by test_row_order.py): prints a JSON report.

A 1 x 1 job runs the same 3 iterations under DeepSpeed's in-order 1F1B plan and under a plan that runs the
worker's own micro-batches out of index order (F, B and W), in fp32 and bf16, with the B/W split and fused; the
report says, per variant, whether the final parameters equal the in-order run's bit for bit.

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/engine/_row_order_job.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

M = 4
ITERATIONS = 3


def main() -> int:
    import torch
    from plans import HandOp, HandPlan, Kind, one_f_one_b

    import ds_recycle
    from ds_recycle.config import load_config
    from ds_recycle.config._strict import to_jsonable
    from ds_recycle.data import MicroBatchSource
    from ds_recycle.engine.row_order import RowOrder
    from ds_recycle.model import build_pipeline_module
    from ds_recycle.resilience.world import init_worker
    from ds_recycle.train.optim import build_optimizer

    init_worker()

    def scrambled() -> HandPlan:
        mb = [(0, i) for i in range(M)]
        f, b, w = ([HandOp(kind, 0, m) for m in mb] for kind in (Kind.F, Kind.B, Kind.W))
        ops = (*f, b[2], w[2], b[0], b[3], w[3], b[1], w[1], w[0], HandOp(Kind.O, 0, None))
        return HandPlan(1, 1, M, frozenset(), {(0, 0): ops}, {(0, m): (0, 0) for m in mb})

    def run(plan: HandPlan, bf16: bool, fused: bool, ordered: bool = True) -> list[torch.Tensor]:
        extra = {"bf16": {"enabled": True}} if bf16 else {}
        cfg = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": M,
                           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                           "recycle": {"stages": 1, "pipelines": 1,
                                       "model": {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 16}}})
        module = build_pipeline_module(cfg.recycle.model, 1)
        engine, *_ = ds_recycle.initialize(model=module,
                                           config={**cfg.deepspeed, **extra, "recycle": to_jsonable(cfg.recycle)},
                                           training_data=MicroBatchSource(cfg), plan=plan,
                                           optimizer=build_optimizer(cfg, module.parameters()))
        engine.capture.fused = fused
        if not ordered:  # the accumulation order the plan runs (what the engine did before RowOrder)
            engine.row_order = RowOrder(lambda pipeline: False)
        for _ in range(ITERATIONS):
            engine.train_batch()
        engine.finish()
        params = [p.detach().float().clone() for p in engine.module.parameters()]
        return params

    def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))

    report: dict[str, bool] = {}
    for bf16 in (False, True):
        reference = run(one_f_one_b(1, 1, M), bf16, fused=False)
        name = "bf16" if bf16 else "fp32"
        report[f"{name} fused in order"] = same(run(one_f_one_b(1, 1, M), bf16, fused=True), reference)
        report[f"{name} split scrambled"] = same(run(scrambled(), bf16, fused=False), reference)
        report[f"{name} fused scrambled"] = same(run(scrambled(), bf16, fused=True), reference)
        if not bf16:
            report[f"{name} split scrambled, plan order"] = same(run(scrambled(), bf16, False, ordered=False),
                                                                 reference)
    print("REPORT " + json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
