"""Failure handling primitives: fault injection, heartbeats, membership agreement over the launcher's store.

Everything here talks only to the rendezvous store that ``ds-recycle launch`` hosts (it outlives
every worker); nothing here uses a process group, so a dead peer can never make these calls hang.
"""
from ds_recycle.resilience.faults import FaultInjector, FaultSpec, Phase, parse_fault
from ds_recycle.resilience.heartbeat import Heartbeat, Liveness
from ds_recycle.resilience.membership import MembershipError, agree_members
from ds_recycle.resilience.store import StoreKeys, connect_store

__all__ = ["FaultInjector", "FaultSpec", "Heartbeat", "Liveness", "MembershipError", "Phase", "StoreKeys",
           "agree_members", "connect_store", "parse_fault"]
