def clamp(value: float, /, lo: float = 0.0, *, hi: float = 1.0) -> float:
    return max(lo, min(hi, value))
