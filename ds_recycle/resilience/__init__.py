"""Failure handling: the handler an engine runs through under ``ds-recycle launch``, and its parts.

The handler (:mod:`~ds_recycle.resilience.handler`) runs the phases of :mod:`~ds_recycle.resilience.phases` over
frozen values; the watchdog (:mod:`~ds_recycle.resilience.watchdog`) is the one failure detector; heartbeats,
membership agreement, rejoin and fallback talk only to the launcher's store, and the engine's transfers run on
per-epoch groups whose waits a dead peer cannot hang (:mod:`~ds_recycle.resilience.transport`).
"""
from ds_recycle.resilience.errors import MembershipError, PeerFailure
from ds_recycle.resilience.faults import FaultInjector, FaultSpec, Phase, parse_fault
from ds_recycle.resilience.heartbeat import Heartbeat
from ds_recycle.resilience.membership import agree_members
from ds_recycle.resilience.store import StoreKeys, connect_store

__all__ = ["FaultInjector", "FaultSpec", "Heartbeat", "MembershipError", "PeerFailure", "Phase", "StoreKeys",
           "agree_members", "connect_store", "parse_fault"]
