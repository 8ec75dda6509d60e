from enum import Enum
from typing import NamedTuple, TypedDict

class Color(Enum):
    RED: int
    GREEN: int

class Point(NamedTuple):
    x: float
    y: float

class Options(TypedDict):
    verbose: bool
