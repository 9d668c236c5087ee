"""Shared test settings: CPU accelerator, one thread per process, no wandb network, a repo-root fixture."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
# every point-to-point message of every job the tests start carries its name, checked on receipt: a message taken
# out of its pair's order (they match in posting order, as on NCCL) fails at once, naming both (engine/p2p.py)
os.environ.setdefault("DS_RECYCLE_CHECK_ORDER", "1")
# torch's store clients look up the name of every connection's address for their logs; a resolver that drops
# queries (as our sandboxed CI machines' does, a few percent of them) stalls that connection for its timeout,
# 5 s by default. One second bounds it for every job the tests start (docs/launcher.md, "reverse DNS").
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo() -> Path:
    """The repository root."""
    return REPO
