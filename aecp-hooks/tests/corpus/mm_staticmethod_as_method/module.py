class Codec:
    def encode(self, data: bytes) -> str:
        return data.hex()
