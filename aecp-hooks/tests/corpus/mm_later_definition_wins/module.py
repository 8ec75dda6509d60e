def parse(text: str) -> list:
    return text.split()


def parse(text: str, sep: str) -> list:
    return text.split(sep)
