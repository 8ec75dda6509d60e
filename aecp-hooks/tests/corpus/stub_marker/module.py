# AECP stub for geo.py
from __future__ import annotations

__aecp_stub__ = "geo.py"


def area(w: int, h: int) -> int:
    return w * h
