def count(items: list) -> str:
    return str(len(items))
