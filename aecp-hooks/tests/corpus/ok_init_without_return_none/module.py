class Stack:
    def __init__(self, size: int):
        self.items = [None] * size

    def clear(self):
        self.items.clear()
