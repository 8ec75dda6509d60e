NAME: bytes = b"x"
