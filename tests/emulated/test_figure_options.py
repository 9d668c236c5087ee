"""The figure benchmark's per-shape forward time: the default, explicit pairs, and bad input named."""
from __future__ import annotations

import pytest

from benchmarks.emulated_figure import DEFAULT_F_MS, f_ms_for

pytestmark = pytest.mark.timeout(60)


def test_default_scales_with_the_workers() -> None:
    assert f_ms_for(DEFAULT_F_MS, 4, 4) == 100.0
    assert f_ms_for(DEFAULT_F_MS, 8, 4) == 200.0
    assert f_ms_for(DEFAULT_F_MS, 8, 8) == 400.0  # not named: 100 ms per 16 workers
    assert f_ms_for(DEFAULT_F_MS, 2, 2) == 100.0  # never below 100 ms


def test_one_number_is_every_shape() -> None:
    assert f_ms_for("250", 4, 4) == f_ms_for("250", 8, 4) == 250.0


def test_pairs_name_their_shape() -> None:
    assert f_ms_for("4x4=80, 8X4=300", 8, 4) == 300.0
    assert f_ms_for("4x4=80, 8X4=300", 4, 4) == 80.0


@pytest.mark.parametrize("spec", ["fast", "4x4=", "4x4=1=2", "4x4:100"])
def test_bad_input_is_named(spec: str) -> None:
    with pytest.raises(SystemExit, match="--f-ms"):
        f_ms_for(spec, 4, 4)
