"""Runtime pieces shared across layers: the survivor grid (:mod:`.grid`, engine and failure handling) and the
job store's schema (:mod:`.job_store`, launcher and workers)."""
from __future__ import annotations

__all__: list[str] = []
