class User:
    def email(self) -> str:
        return "a@b.c"
