class InsufficientFunds:
    def __init__(self, amount: int):
        self.amount = amount
