class Record:
    def __init__(self, **fields: object) -> None:
        self.__dict__.update(fields)

    @classmethod
    def setup(cls) -> None:
        cls.registry = {}
