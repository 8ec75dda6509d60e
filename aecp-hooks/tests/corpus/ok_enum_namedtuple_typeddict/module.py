from enum import Enum, auto
from typing import NamedTuple, TypedDict


class Color(Enum):
    RED = auto()
    GREEN = auto()


class Point(NamedTuple):
    x: float
    y: float = 0.0


class Options(TypedDict, total=False):
    verbose: bool
