def connect(host: str, port: int) -> None:
    pass
