def f(x: int) -> int:
    return max(x, 0


def g():
    return 1
