"""4 ranks: SurvivorGrid's groups against DeepSpeed's PipelineParallelGrid's (run by test_grid.py).

    RANK=r WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/engine/_grid_job.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipelineParallelGrid

    from ds_recycle.resilience.world import init_worker
    from ds_recycle.runtime.grid import SurvivorGrid, WorkerMap

    init_worker()
    ours = SurvivorGrid(WorkerMap.dense(2, 2), timeout_s=60)
    theirs = PipelineParallelGrid(topology=PipeDataParallelTopology(num_pp=2, num_dp=2))
    one = torch.ones(1)
    dist.all_reduce(one, group=ours.get_pipe_parallel_group())
    report = {
        "pipe": [dist.get_process_group_ranks(ours.get_pipe_parallel_group()), ours.pp_group,
                 dist.get_process_group_ranks(theirs.get_pipe_parallel_group()), list(theirs.pp_group)],
        "data": [dist.get_process_group_ranks(ours.get_data_parallel_group()),
                 dist.get_process_group_ranks(theirs.get_data_parallel_group())],
        "pipe_sum": float(one),
    }
    print("REPORT " + json.dumps(report), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
