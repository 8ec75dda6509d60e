class Session:
    def __init__(self, user: str) -> None:
        self.user = user
        expires = 0.0
