from typing import TYPE_CHECKING

if TYPE_CHECKING:
    def load(path: str) -> dict: ...
