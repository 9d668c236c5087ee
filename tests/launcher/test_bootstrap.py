"""The launcher's bootstrap: the user's script runs as __main__ with its argv, DeepSpeed's init routed to ours."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "DS_ACCELERATOR": "cpu"})


def test_deepspeed_imported_later_gets_the_routed_init_distributed() -> None:
    code = ("from ds_recycle.launcher.bootstrap import install_deepspeed_hook\n"
            "install_deepspeed_hook()\n"
            "import deepspeed, deepspeed.comm\n"
            "print(deepspeed.init_distributed.__name__, deepspeed.comm.init_distributed.__name__)\n"
            "from deepspeed.comm.comm import init_distributed\n"
            "print(init_distributed.__module__)\n")
    out = _run("-c", code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-3:] == ["_recycle_init_distributed", "_recycle_init_distributed", "deepspeed.comm.comm"]


def test_script_runs_as_main_with_its_own_argv_and_directory(tmp_path: Path) -> None:
    script = tmp_path / "user.py"
    (tmp_path / "helper_mod.py").write_text("VALUE = 7\n")
    script.write_text("import sys, helper_mod\nprint(__name__, sys.argv[1:], helper_mod.VALUE)\n")
    out = _run("-m", "ds_recycle.launcher.bootstrap", str(script), "--local_rank=0", "--x", "1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "__main__ ['--local_rank=0', '--x', '1'] 7"
    assert _run("-m", "ds_recycle.launcher.bootstrap").returncode == 2
