class make:
    def __init__(self, n: int):
        self.n = n


def Thing():
    return object()
