from abc import ABC, abstractmethod
from typing import Protocol

class Store(ABC):
    @abstractmethod
    def get(self, key: str) -> bytes: ...
    def has(self, key: str) -> bool: ...

class Reader(Protocol):
    def read(self, n: int) -> bytes: ...
