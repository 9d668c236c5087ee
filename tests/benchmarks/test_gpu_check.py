"""``benchmarks/gpu_check.py --dry-run``: the GPU check runs its parts on CPU so that it cannot rot; a part that
cannot run says why and is never reported as passed."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_check import Row, table

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.multiprocess  # (a) runs two 4-worker jobs
def test_dry_run_kills_a_worker_of_the_job_measures_the_split_and_the_one_rank_group_and_says_what_it_did_not_run(tmp_path: Path) -> None:
    out = tmp_path / "table.txt"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--dry-run", "--repeats", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=280, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split(None, 1) for line in out.read_text().splitlines()[2:]]
    parts = [part for part, _ in rows]
    assert parts == ["b", "b", "c", "c", "a", "a", "d"], out.read_text()
    by_part = {part: [rest for p, rest in rows if p == part] for part in "abcd"}
    assert all(rest.rstrip().endswith("ok") and "ratio" in rest for rest in by_part["b"])
    assert by_part["c"][0].rstrip().endswith("ok") and "not run:" in by_part["c"][1]
    # (a): the CPU/GPU comparison needs a GPU; the outside kill runs (on the CPU) and ends at the same model
    assert "not run: no GPU" in by_part["a"][0]
    assert "SIGKILLed from outside" in by_part["a"][1] and "bit-identical" in by_part["a"][1], out.read_text()
    assert by_part["a"][1].rstrip().endswith("ok") and "failure" in by_part["a"][1]
    assert all("not run:" in rest for rest in by_part["d"])


@pytest.mark.parametrize(("args", "message"), [(["--repeats", "0"], "--repeats 0: give 1 or more"),
                                               (["--parts", "ax"], "--parts 'ax': give letters among a, b, c and d")])
def test_bad_options_are_refused_at_once(args: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 2 and message in done.stderr


def test_a_failed_row_is_shown_as_failed() -> None:
    rows = [Row("b", "s", "r", "ok"), Row("c", "s", "r", "FAILED: exit 1")]
    assert [r.failed for r in rows] == [False, True]
    assert table(rows).splitlines()[2].endswith("FAILED: exit 1")
