class Conn:
    __slots__ = ("host", "port", "timeout", "retries", "state", "buffer")
    retries: int

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port: int = port
        self.timeout = self.retries = 0
        self.reset()

    def reset(self):
        self.state = "idle"
