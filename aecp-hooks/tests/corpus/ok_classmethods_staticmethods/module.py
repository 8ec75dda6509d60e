class Money:
    @classmethod
    def parse(klass, text: str) -> "Money":
        return klass()

    @staticmethod
    def valid(text: str) -> bool:
        return bool(text)

    def add(this, other: "Money") -> "Money":
        return this
