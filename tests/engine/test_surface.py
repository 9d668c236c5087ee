"""Every public name of DeepSpeed's ``PipelineEngine`` is honoured or refused at the call (``engine/surface.py``)."""
from __future__ import annotations

import pytest
from deepspeed.runtime.pipe.engine import PipelineEngine

from ds_recycle.engine import surface
from ds_recycle.engine.engine import RecyclePipelineEngine

PUBLIC = sorted(n for n in dir(PipelineEngine) if not n.startswith("_"))


def test_every_public_name_is_classified() -> None:
    unclassified = [n for n in PUBLIC if surface.classify(n) is None]
    assert not unclassified, f"classify these in ds_recycle/engine/surface.py (own, inherited or refused): {unclassified}"


def test_own_names_are_implemented_by_the_engine_and_inherited_ones_are_not_replaced() -> None:
    assert all(n in RecyclePipelineEngine.__dict__ for n in surface.OWN)
    replaced = [n for n in PUBLIC if surface.classify(n) == "inherited" and n in RecyclePipelineEngine.__dict__]
    assert not replaced, f"overridden but classified inherited: {replaced}"


@pytest.mark.parametrize("name", sorted(surface.REFUSED))
def test_refused_names_raise_naming_the_method_and_the_fix(name: str) -> None:
    with pytest.raises(surface.UnsupportedCallError, match=rf"engine\.{name}\(\) is not supported.*: .+"):
        getattr(RecyclePipelineEngine, name)(object(), 1, key=2)


def test_the_walk_covers_the_whole_surface() -> None:
    counts = {kind: sum(surface.classify(n) == kind for n in PUBLIC) for kind in ("own", "inherited", "refused")}
    assert sum(counts.values()) == len(PUBLIC) and min(counts.values()) > 0, counts
