from dataclasses import dataclass, field
from typing import ClassVar


@dataclass
class Order:
    registry: ClassVar[dict] = {}
    id: int
    items: list[str] = field(default_factory=list)
    note: str = ""

    def total(self) -> int:
        return len(self.items)
