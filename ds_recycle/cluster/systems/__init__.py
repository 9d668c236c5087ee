"""One module per simulated fault-tolerance system; `SYSTEMS` maps each kind to its class."""
from __future__ import annotations

from ds_recycle.cluster.systems.bamboo import Bamboo
from ds_recycle.cluster.systems.base import EventQueue, SimContext, System, SystemKind
from ds_recycle.cluster.systems.checkpoint import CheckpointRestart
from ds_recycle.cluster.systems.oobleck import Oobleck, distribute_batch
from ds_recycle.cluster.systems.recycle import ReCycle
from ds_recycle.cluster.systems.recycle_repartition import ReCycleRepartition
from ds_recycle.cluster.systems.replica_drop import ReplicaDrop, ReplicaRedistribute

__all__ = ["SYSTEMS", "System", "SystemKind", "SimContext", "EventQueue", "parse_systems",
           "ReCycle", "ReCycleRepartition", "Oobleck", "Bamboo", "CheckpointRestart", "ReplicaDrop", "ReplicaRedistribute",
           "distribute_batch"]

SYSTEMS: dict[SystemKind, type[System]] = {
    SystemKind.RECYCLE: ReCycle,
    SystemKind.RECYCLE_REPARTITION: ReCycleRepartition,
    SystemKind.OOBLECK: Oobleck,
    SystemKind.BAMBOO: Bamboo,
    SystemKind.CHECKPOINT: CheckpointRestart,
    SystemKind.DROP: ReplicaDrop,
    SystemKind.RECOVER: ReplicaRedistribute,
}


def parse_systems(text: str) -> list[SystemKind]:
    """`"recycle,oobleck"` -> kinds; `"all"` -> every system. Unknown names are a ValueError."""
    if text.strip() == "all":
        return list(SYSTEMS)
    kinds: list[SystemKind] = []
    for name in (n.strip() for n in text.split(",")):
        try:
            kind = SystemKind(name)
        except ValueError:
            raise ValueError(f"--systems: {name!r} is not a system. Fix: a comma-separated list of "
                             f"{', '.join(k.value for k in SYSTEMS)} (or 'all')") from None
        if kind not in kinds:
            kinds.append(kind)
    if not kinds:
        raise ValueError("--systems is empty. Fix: e.g. --systems recycle,oobleck")
    return kinds
