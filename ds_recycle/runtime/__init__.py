"""Runtime pieces shared by the ReCycle engine and the failure handling: the survivor grid."""
from __future__ import annotations

__all__: list[str] = []
