class Queue:
    def __init__(self):
        self.items = []

    def push(self, item: object) -> None:
        self.items.append(item)
