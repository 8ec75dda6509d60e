def send(to: str, body: str, retries: int = 3, timeout: float = 10.0, *, trace: bool = False, **extra) -> bool:
    return True


class Mailer:
    def send(self, to: str, priority: int = 0, *, cc: str | None = None, bcc: str | None = None) -> bool:
        return True
