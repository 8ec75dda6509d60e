class Model:
    class Meta:
        table = "models"

        def columns(self) -> list[str]:
            return ["id"]

    def save(self) -> None:
        print("saved", self.Meta.table)
