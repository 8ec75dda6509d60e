from enum import IntEnum
from orm import Record


class AcctError(ValueError):
    pass


class _Middle(AcctError):
    pass


class Overdrawn(_Middle):
    pass


class Level(IntEnum):
    LOW = 1


class Model(Record):
    pass
