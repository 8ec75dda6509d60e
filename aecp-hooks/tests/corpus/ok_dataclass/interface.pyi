from dataclasses import dataclass

@dataclass
class Order:
    id: int
    items: list[str]
    note: str
    def __init__(self, id: int, items: list[str] = ..., note: str = ...) -> None: ...
    def total(self) -> int: ...
