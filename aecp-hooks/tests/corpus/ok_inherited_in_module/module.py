class Base:
    name = "shape"

    def describe(self) -> str:
        return f"{self.name} of area {self.area()}"


class Shape(Base):
    def area(self) -> float:
        return 0.0


class Square(Shape):
    def __init__(self, side: float):
        self.side = side

    def area(self) -> float:
        return self.side ** 2
