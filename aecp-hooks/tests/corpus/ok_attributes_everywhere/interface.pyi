class Conn:
    host: str
    port: int
    timeout: float
    retries: int
    state: str
    buffer: bytes
    def __init__(self, host: str, port: int) -> None: ...
