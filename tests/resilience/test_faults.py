"""Fault specs parse strictly, and the injector kills exactly the targeted worker at its moment."""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from ds_recycle.resilience import FaultSpec, Phase, parse_fault


def test_parse_round_trip() -> None:
    spec = parse_fault("1:0@5:backward-weight")
    assert spec == FaultSpec(1, 0, 5, Phase.BACKWARD_WEIGHT)
    assert parse_fault(str(spec)) == spec


@pytest.mark.parametrize("text, words", [("1:0@5", "PIPELINE:STAGE@ITERATION:PHASE"),
                                         ("1:0@5:lunch", "unknown phase 'lunch'"),
                                         ("a:0@5:forward", "e.g. 1:0@5:forward")])
def test_parse_errors_say_the_fix(text: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_fault(text)


PROGRAM = """
import sys
from ds_recycle.resilience import FaultInjector, Phase, parse_fault
inj = FaultInjector([parse_fault("1:0@2:forward")], pipeline=int(sys.argv[1]), stage=0)
for it in range(4):
    for phase in Phase:
        inj.reached(it, phase)
print("finished")
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipeline, killed", [(1, True), (0, False)])
def test_injector_sigkills_only_the_target(pipeline: int, killed: bool) -> None:
    proc = subprocess.run([sys.executable, "-c", PROGRAM, str(pipeline)], capture_output=True, text=True, timeout=50)
    if killed:
        assert proc.returncode == -signal.SIGKILL and "finished" not in proc.stdout
    else:
        assert proc.returncode == 0 and "finished" in proc.stdout
