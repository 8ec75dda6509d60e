def call(fn) -> object:
    return fn()
