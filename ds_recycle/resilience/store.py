"""The launcher's store: how a worker reaches it, and every key ds_recycle keeps there.

Key layout (all under ``ds_recycle/``; the launcher writes the first three, see
:mod:`ds_recycle.runtime.job_store`, which owns their names; workers write the rest):

=====================================  =========================================================
``ds_recycle/exit/<rank>``             the worker's exit status, written by its launcher at death
``ds_recycle/exits``                   counter, incremented at each worker exit (cheap to poll)
``ds_recycle/exit_queue/<rank>``       queue of exit counts, one push per exit (the rank's watchdog pops it)
``ds_recycle/hb/<rank>``               heartbeat counter, incremented by the worker every period
``ds_recycle/epoch/<e>/alive/<rank>``  the worker reached agreement round ``e``
``ds_recycle/epoch/<e>/members``       the agreed live ranks of round ``e`` (first writer wins)
``ds_recycle/epoch/<e>/report/<rank>`` where the worker stood when round ``e`` began (JSON ``Position``)
``ds_recycle/epoch/<e>/end/count``     counter of the members of ``e`` whose training is over
``ds_recycle/epoch/<e>/end/outcome``   ``done`` or ``failed``: how the end of training in ``e`` went (set once)
``ds_recycle/epoch/<e>/final/<s>``     stage ``s``'s final parameters, when the script asked for them
``ds_recycle/join/requests``           counter of join requests filed by restarted workers
``ds_recycle/join/request/<n>``        the rank that filed request ``n``
``ds_recycle/join/ticket/<n>``         the members' answer to request ``n`` (JSON, see ``rejoin``)
``ds_recycle/join/closed``             training is over: no more joins
=====================================  =========================================================

After a fallback to a checkpoint, the workers' keys live under ``ds_recycle/gen<g>/`` instead.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from ds_recycle.runtime import job_store as launcher_store

__all__ = ["StoreKeys", "connect_store", "incarnation"]


@dataclass(frozen=True)
class StoreKeys:
    """Builders for the key names above, so no module spells a key by hand."""

    root: str = "ds_recycle"

    def exit(self, rank: int) -> str:
        return launcher_store.exit_key(rank)

    @property
    def exits(self) -> str:
        return launcher_store.EXITS_KEY

    def exit_queue(self, rank: int) -> str:
        return launcher_store.exit_queue_key(rank)

    def heartbeat(self, rank: int) -> str:
        return f"{self.root}/hb/{rank}"

    def alive(self, epoch: int, rank: int) -> str:
        return f"{self.root}/epoch/{epoch}/alive/{rank}"

    def members(self, epoch: int) -> str:
        return f"{self.root}/epoch/{epoch}/members"

    def report(self, epoch: int, rank: int) -> str:
        return f"{self.root}/epoch/{epoch}/report/{rank}"

    def end_count(self, epoch: int) -> str:
        """Counter of the members of ``epoch`` whose training is over (:func:`~ds_recycle.resilience.phases.end_barrier`)."""
        return f"{self.root}/epoch/{epoch}/end/count"

    def shrink_vote(self, question: str, epoch: int, rank: int) -> str:
        """``1`` or ``0``: ``rank``'s answer to ``question`` about shrinking the failed epoch's NCCL communicators
        into epoch ``epoch`` (``kept``: it still has them; ``done``: it shrank them)."""
        return f"{self.root}/epoch/{epoch}/shrink/{question}/{rank}"

    def end_outcome(self, epoch: int) -> str:
        """``done`` or ``failed``: the end of training in ``epoch``, decided once (the first ``compare_set`` wins)."""
        return f"{self.root}/epoch/{epoch}/end/outcome"

    def final_stage(self, epoch: int, stage: int) -> str:
        """The final parameters of ``stage`` (``torch.save`` bytes), written in ``epoch`` by its first member."""
        return f"{self.root}/epoch/{epoch}/final/{stage}"

    @property
    def started_count(self) -> str:
        """Counter of the ranks whose first epoch is built (the start-up barrier of
        :func:`~ds_recycle.resilience.phases.end_start_up`)."""
        return f"{self.root}/started_count"

    @property
    def join_requests(self) -> str:
        return f"{self.root}/join/requests"

    def join_request(self, number: int) -> str:
        return f"{self.root}/join/request/{number}"

    def join_ticket(self, number: int) -> str:
        return f"{self.root}/join/ticket/{number}"

    @property
    def join_closed(self) -> str:
        return f"{self.root}/join/closed"

    def hung(self, rank: int) -> str:
        """``"<restart count> <reason>"``: the rank's watcher declared that process hung (and had it fenced)."""
        return f"{self.root}/hung/{rank}"

    @property
    def hung_declarations(self) -> str:
        """Counts the ``hung`` declarations, so that a watchdog looks at the keys only when one was made."""
        return f"{self.root}/hung/count"

    def restarted(self, rank: int) -> str:
        return launcher_store.restarted_key(rank)


def connect_store(timeout_s: float = 30.0, address: str | None = None) -> dist.Store:
    """A new client of the job's store (``$DS_RECYCLE_STORE``, set by ``ds-recycle launch``: ``host:port`` of its
    TCPStore, or ``etcd://...`` with ``--store``)."""
    address = address or os.environ.get("DS_RECYCLE_STORE")
    if not address or ":" not in address:
        raise RuntimeError("DS_RECYCLE_STORE is not set to host:port: failure survival needs the store of "
                           "'ds-recycle launch' (the deepspeed launcher and torchrun kill survivors anyway)")
    return launcher_store.open_store(address, timeout_s)


def incarnation(store: dist.Store, keys: StoreKeys, rank: int) -> int:
    """How many times the launcher restarted ``rank`` (0: its first process)."""
    key = keys.restarted(rank)
    return int(store.get(key)) if store.check([key]) else 0
