from dataclasses import dataclass


@dataclass
class Item:
    name: str
    qty: int
