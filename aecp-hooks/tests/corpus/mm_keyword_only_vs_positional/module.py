def resize(image: bytes, *, width: int, height: int) -> bytes:
    return image
