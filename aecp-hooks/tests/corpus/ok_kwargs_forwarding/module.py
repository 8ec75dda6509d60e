import urllib.request


def fetch(*args, **kwargs) -> bytes:
    return _fetch(*args, **kwargs)


def _fetch(url, timeout=5.0, *, headers=None):
    return urllib.request.urlopen(url, timeout=timeout).read()
