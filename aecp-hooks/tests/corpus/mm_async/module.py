def fetch(url: str) -> bytes:
    return b""


async def parse(data: bytes) -> dict:
    return {}
