from typing import AsyncIterator, NamedTuple


class Registry:
    def names(self) -> list[str]:
        return []


class Pair(NamedTuple):
    left: int
    right: int


async def ticks(n: int) -> AsyncIterator[int]:
    for i in range(n):
        yield i
