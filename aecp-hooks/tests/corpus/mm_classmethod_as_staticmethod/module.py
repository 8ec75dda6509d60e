class Config:
    @staticmethod
    def load(path: str) -> "Config":
        return Config()
