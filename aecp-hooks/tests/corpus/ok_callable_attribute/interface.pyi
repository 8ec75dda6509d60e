from typing import Callable

class Button:
    on_click: Callable[[int], None]
