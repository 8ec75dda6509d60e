def area(w: int, h: int) -> int:
    """Width times height."""
    ...


def perimeter(w: int, h: int) -> int:
    return 2 * (w + h)
