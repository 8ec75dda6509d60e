def transfer(src: str, dst: str, amt: int) -> None:
    pass
