"""``import ds_recycle`` keeps DeepSpeed's CPU shm op from being JIT-compiled, in either import order."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

_FIRST = {
    "deepspeed-first": "import deepspeed\nimport ds_recycle\n",
    "ds_recycle-first": "import ds_recycle\nassert 'torch' not in sys.modules  # still light\nimport deepspeed\n",
}
_AFTER = ("import deepspeed.ops\n"
          "deepspeed.init_distributed(dist_backend='gloo')\n"
          "print('compatible', deepspeed.ops.__compatible_ops__['deepspeed_shm_comm'])\n")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("order", sorted(_FIRST))
def test_init_distributed_does_not_compile_the_shm_op(order: str, tmp_path: Path) -> None:
    extensions = tmp_path / "torch_extensions"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
           "TORCH_EXTENSIONS_DIR": str(extensions), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port())}
    for key in ("DS_RECYCLE_LAUNCHER", "DS_RECYCLE_STORE"):
        env.pop(key, None)
    code = "import sys\n" + _FIRST[order] + _AFTER
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=100)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "compatible False" in run.stdout, run.stdout + run.stderr[-3000:]
    assert not extensions.exists() or not any(extensions.rglob("*.so")), "an op was built"
