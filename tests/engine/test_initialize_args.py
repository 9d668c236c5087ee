"""``ds_recycle.initialize``'s DeepSpeed arguments that concern the process group, honoured as DeepSpeed does."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_CHECK = """
import torch.distributed as dist
from ds_recycle.api import _init_distributed
assert not dist.is_initialized()
try:
    _init_distributed(29500, False)
except RuntimeError as e:
    print("REFUSED", e)
"""


def test_initialize_without_an_initialized_world_and_dist_init_required_false_says_how() -> None:
    """As ``deepspeed.initialize``: ``dist_init_required=False`` means the script initialised torch.distributed
    (checked in a fresh process: this one may have a process group from another test)."""
    done = subprocess.run([sys.executable, "-c", _CHECK], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert "REFUSED" in done.stdout and "dist_init_required=None or True" in done.stdout, done.stdout + done.stderr
