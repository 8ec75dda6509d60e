class Model:
    class Meta:
        table: str
        ordering: list[str]
