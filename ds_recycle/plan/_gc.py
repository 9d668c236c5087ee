"""Pausing Python's cyclic garbage collector while plans are built.

A plan is hundreds of thousands of small acyclic objects (ops, queue items, tuples). Each allocation burst
triggers the cyclic collector, whose oldest generation re-scans every live object, including the plans a
cache already holds: precomputing the 73 plans of S=8, D=8, M=32 took 27 s of CPU with the collector and
10 s without. Reference counting frees all of these objects anyway; nothing the planner builds is cyclic.
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["gc_paused"]


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic collector inside the block; re-enable it after only if it was enabled before."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
