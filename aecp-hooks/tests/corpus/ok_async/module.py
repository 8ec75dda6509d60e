import asyncio


def _join(a, b):
    return a + b


async def fetch(url: str) -> bytes:
    await asyncio.sleep(0)
    return url.encode()


class Client:
    async def get(self, path: str) -> bytes:
        return await fetch(_join("http://x/", path))

    def close(self) -> None:
        pass
