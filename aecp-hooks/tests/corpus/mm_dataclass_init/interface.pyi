from dataclasses import dataclass

@dataclass
class Item:
    name: str
    qty: int
    def __init__(self, name: str, qty: int = ...) -> None: ...
