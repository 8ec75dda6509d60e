TIMEOUT: float
NAME: str
