import functools


class Temp:
    unit = "C"

    def __init__(self):
        self._c = 0.0

    @property
    def celsius(self) -> float:
        return self._c

    @celsius.setter
    def celsius(self, value: float) -> None:
        self._c = value

    @functools.cached_property
    def kelvin(self) -> float:
        return self._c + 273.15
