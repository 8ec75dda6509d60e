import functools
from functools import lru_cache


def logged(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


@lru_cache(maxsize=128)
def rate(currency: str) -> float:
    return {"EUR": 1.0}.get(currency, 2.0)


@logged
def convert(amount: float, currency: str) -> float:
    return amount * rate(currency)
