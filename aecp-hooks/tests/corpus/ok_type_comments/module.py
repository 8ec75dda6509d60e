def area(w, h):
    # type: (int, int) -> int
    return w * h


def label(n):  # type: (int) -> str
    return str(n)
