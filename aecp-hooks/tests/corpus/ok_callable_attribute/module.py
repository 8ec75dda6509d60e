class Button:
    def on_click(self, n: int) -> None:
        print(n)
