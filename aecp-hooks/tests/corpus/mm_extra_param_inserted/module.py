def move(src: str, force: bool = False, dst: str = "") -> None:
    pass
