class Repo:
    def load(self, key: str):
        return b""
