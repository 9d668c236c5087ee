"""Every modelling number of the simulation in one place, each with where it comes from.

`resolve_assumptions` derives them from the workload, the job shape and the trace; the CLI and the
benchmark print `describe()` next to the results, and the sensitivity study varies them with
`dataclasses.replace`.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, fields

from ds_recycle.cluster.timing import JobShape
from ds_recycle.cluster.workload import Workload

__all__ = ["ShrinkPolicy", "Assumptions", "resolve_assumptions", "SOURCES"]


class ShrinkPolicy(enum.Enum):
    """What checkpoint-restart does when too few nodes are left for D pipelines."""

    SHRINK = "shrink"
    """Restart on fewer pipelines, keeping the global batch by gradient accumulation (elastic torchrun)."""
    WAIT = "wait"
    """Stop until replacements bring the job back to D pipelines (plain DeepSpeed / torchrun)."""


@dataclass(frozen=True)
class Assumptions:
    """Resolved model parameters (seconds unless named otherwise); sources in :data:`SOURCES`."""

    node_start_s: float
    checkpoint_interval_s: float
    checkpoint_cost_s: float
    restart_s: float
    reconfigure_s: float
    rejoin_copy_s: float
    oobleck_reconfigure_s: float
    oobleck_min_nodes: int
    bamboo_overhead: float
    bamboo_failover_slowdown: float
    bamboo_reconfigure_s: float
    bamboo_reconfigure_threshold: float
    bamboo_node_state_gb: float
    shrink_policy: ShrinkPolicy = ShrinkPolicy.SHRINK
    recycle_rebalance: bool = False
    repartition_after_iterations: int = 3
    repartition_horizon: int = 100

    def describe(self) -> list[tuple[str, str, str]]:
        """(name, value, source) rows for the report."""
        rows = []
        for f in fields(self):
            value = getattr(self, f.name)
            text = value.value if isinstance(value, enum.Enum) else str(value) if isinstance(
                value, bool) else (
                f"{value:.4g}" if isinstance(value, float) else str(value))
            rows.append((f.name, text, SOURCES[f.name]))
        return rows


_OOBLECK_SIM = "Oobleck's public simulator (SymbioticLab/Oobleck, tools/simulator, sosp23-artifact)"

SOURCES: dict[str, str] = {
    "node_start_s": f"spot-instance creation time of {_OOBLECK_SIM}: an added node is usable 45 s later",
    "checkpoint_interval_s": "Young's optimum sqrt(2 x cost x job MTBF) (Young 1974, 'A first order "
                             "approximation to the optimum checkpoint interval'); the job MTBF is the "
                             "trace's span over its removals; the best case for checkpoint-restart",
    "checkpoint_cost_s": "largest stage's model state (16 B/param, ZeRO arXiv 1910.02054) written by "
                         "each stage's first replica in parallel at the node's storage bandwidth "
                         "(2.5 GB/s, GEMINI SOSP 2023); every system checkpoints the same way",
    "restart_s": f"per-model restart time of the Bamboo/Varuna model in {_OOBLECK_SIM} "
                 "(100/230/450 s) plus reading the checkpoint back at storage bandwidth",
    "reconfigure_s": f"per-model 'local rendezvous' of {_OOBLECK_SIM} (3/6/10 s): detect, agree, "
                     "re-form groups; ReCycle's re-plan (a cache lookup) and torchft's quorum use it",
    "rejoin_copy_s": "a rejoining or spare node copies its stage's model state from a live peer at "
                     "the inter-node bandwidth (100 GB/s), while the others keep training",
    "oobleck_reconfigure_s": f"{_OOBLECK_SIM} 'local rendezvous' (3/6/10 s) plus copying the "
                             "largest missing stage's state from another pipeline",
    "oobleck_min_nodes": "fewest nodes a pipeline template may have: model state within half the "
                         "node memory (the rest for activations), as Oobleck's templates require",
    "bamboo_overhead": f"throughput lost to redundant computation: 19.71% ({_OOBLECK_SIM}, "
                       "redundant_ratio = 1 - 0.1971; Bamboo NSDI'23 reports RC overheads of this order)",
    "bamboo_failover_slowdown": f"iteration-time factor while a node runs its failed successor's stage "
                                f"too: 1.5 ({_OOBLECK_SIM}, fallback_slowdown)",
    "bamboo_reconfigure_s": f"Bamboo's rendezvous time per model (100/230/450 s) in {_OOBLECK_SIM}",
    "bamboo_reconfigure_threshold": f"Bamboo re-balances when 2 x overloaded / active nodes > 5% "
                                    f"({_OOBLECK_SIM}) or when waiting nodes can relieve the overloaded",
    "bamboo_node_state_gb": "Bamboo's memory cost: a node holds its own stage's model state and its "
                            "successor's (twice the others'); checked against the node's GPU memory",
    "shrink_policy": "elastic restart on fewer pipelines keeping the global batch (torchrun elastic); "
                     "'wait' stops until D pipelines can be formed again",
    "recycle_rebalance": "beyond the paper, off by default: after a failure ReCycle may move a live node "
                         "from the stage with the fewest failures to the one with the most (state copy "
                         "from a peer plus a re-plan) whenever the planner says the job gets faster",
    "repartition_after_iterations": "ReCycle + re-partition: iterations a membership must last before the "
                                    "planner considers moving layers (a failure healed sooner is only re-routed)",
    "repartition_horizon": "ReCycle + re-partition: iterations over which the time a move saves must exceed "
                           "the move's transfer (its layers' 16 B/param state at the inter-node bandwidth)",
}


def resolve_assumptions(workload: Workload, shape: JobShape, job_mtbf_s: float,
                        shrink_policy: ShrinkPolicy = ShrinkPolicy.SHRINK,
                        checkpoint_interval_s: float | None = None,
                        recycle_rebalance: bool = False) -> Assumptions:
    """The numbers for this workload, shape and failure rate (see :data:`SOURCES`)."""
    hw = workload.hardware
    stage_bytes = workload.stage_state_bytes(shape.stages)
    ckpt_cost = stage_bytes / (hw.storage_gbs * 1e9)
    interval = checkpoint_interval_s
    if interval is None:
        interval = math.sqrt(2.0 * max(ckpt_cost, 1e-3) * job_mtbf_s) if math.isfinite(job_mtbf_s) \
            else 3600.0
    copy_s = stage_bytes / (hw.inter_node_gbs * 1e9)
    min_nodes = max(1, math.ceil(workload.state_bytes_total / (0.5 * hw.node_memory_gb * 1e9)))
    return Assumptions(
        node_start_s=hw.node_start_s,
        checkpoint_interval_s=interval,
        checkpoint_cost_s=ckpt_cost,
        restart_s=workload.restart_s + ckpt_cost,
        reconfigure_s=workload.reconfigure_s,
        rejoin_copy_s=copy_s,
        oobleck_reconfigure_s=workload.reconfigure_s + copy_s,
        oobleck_min_nodes=min(min_nodes, shape.stages),
        bamboo_overhead=0.1971,
        bamboo_failover_slowdown=1.5,
        bamboo_reconfigure_s=workload.restart_s,
        bamboo_reconfigure_threshold=0.05,
        bamboo_node_state_gb=2.0 * stage_bytes / 1e9,
        shrink_policy=shrink_policy,
        recycle_rebalance=recycle_rebalance,
    )
