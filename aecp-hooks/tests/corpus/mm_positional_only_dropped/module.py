def head(seq: list, n: int = 1) -> list:
    return seq[:n]
