import sys

try:
    from fastjson import dumps
except ImportError:
    import json

    def dumps(obj: object) -> str:
        return json.dumps(obj)

if sys.platform == "win32":
    def now() -> float:
        return 0.0
else:
    import time

    def now() -> float:
        return time.time()
