def _handle(event: dict) -> None:
    pass


handler = _handle
square = lambda x: x * x


class _ParserImpl:
    pass


Parser = _ParserImpl
