class Model:
    class Meta:
        table = "models"
