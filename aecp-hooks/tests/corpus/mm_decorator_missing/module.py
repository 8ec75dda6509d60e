class Point:
    x: int
    y: int
