class Session:
    user: str
    expires: float
    def __init__(self, user: str) -> None: ...
