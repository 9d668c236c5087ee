"""Leaving without module teardown keeps what a normal exit guarantees: threads joined, atexit run, files flushed,
the same exit status (ds_recycle/launcher/leave.py)."""
from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from ds_recycle.launcher.leave import exit_status, open_file_objects

_PROGRAM = """
import atexit, sys, threading, time
from ds_recycle.launcher.leave import leave

log = open(sys.argv[1], "w")  # never closed: its buffer must still reach the file
log.write("written before leaving\\n")

def late() -> None:
    time.sleep(0.3)
    log.write("written by a thread still running\\n")

threading.Thread(target=late).start()
atexit.register(lambda: log.write("written at exit\\n"))
print("to stdout", end="")
leave(sys.argv[2] if sys.argv[2] == "text" else int(sys.argv[2]))
"""


@pytest.mark.parametrize(("code", "status"), [("0", 0), ("3", 3), ("text", 1)])
def test_leave_joins_threads_runs_atexit_flushes_files_and_keeps_the_status(tmp_path: Path, code: str,
                                                                            status: int) -> None:
    log = tmp_path / "log.txt"
    done = subprocess.run([sys.executable, "-c", _PROGRAM, str(log), code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == status, done.stderr
    assert log.read_text().splitlines() == ["written before leaving", "written by a thread still running",
                                            "written at exit"]
    assert done.stdout == "to stdout"
    assert done.stderr == ("text\n" if code == "text" else "")


def test_exit_status_is_the_interpreters() -> None:
    assert [exit_status(c) for c in (None, 0, 7, 256 + 2)] == [0, 0, 7, 2]


def test_the_bootstrap_leaves_with_the_scripts_status(tmp_path: Path) -> None:
    """A script run by the workers' bootstrap ends with its own ``sys.exit`` status, its output flushed."""
    script = tmp_path / "s.py"
    script.write_text("import sys\nprint('ran', sys.argv[1:])\nsys.exit(5)\n")
    done = subprocess.run([sys.executable, "-m", "ds_recycle.launcher.bootstrap", str(script), "--x"],
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (5, "ran ['--x']\n"), done.stderr


class _UserLog(io.StringIO):
    """A file object of the user's own class."""


def test_open_file_objects_finds_every_kind_of_file_and_nothing_else(tmp_path: Path) -> None:
    text, binary = open(tmp_path / "t", "w"), open(tmp_path / "b", "wb")
    raw, mine = open(tmp_path / "r", "wb", buffering=0), _UserLog()
    try:
        found = open_file_objects()
        for f in (text, binary, raw, mine, sys.stdout, sys.stderr):
            assert any(g is f for g in found), f
        assert all(isinstance(g, io.IOBase) for g in found)
        assert not any(g is tmp_path for g in found)
    finally:
        for f in (text, binary, raw):
            f.close()
