"""Golden plans. Regenerate after an intended change with:

    PYTHONPATH=. python tests/plan/golden/regenerate.py
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_recycle.plan import validate_document
from tests.plan.golden.regenerate import CASES, build

GOLDEN = Path(__file__).parent / "golden"


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name: str) -> None:
    expected = json.loads((GOLDEN / f"{name}.json").read_text())
    validate_document(expected)
    assert build(name) == expected
