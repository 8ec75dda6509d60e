def version() -> str:
    return "1.0"


def __getattr__(name):
    if name == "legacy_api":
        return lambda x: x
    raise AttributeError(name)
