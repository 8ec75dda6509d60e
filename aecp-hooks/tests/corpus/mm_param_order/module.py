class Ledger:
    def move(self, dst: str, src: str) -> None:
        pass
