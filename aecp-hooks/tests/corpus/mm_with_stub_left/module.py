def a(x: int) -> int:
    ...


def b(y: int) -> int:
    return y
