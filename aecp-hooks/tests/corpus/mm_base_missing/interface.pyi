class InsufficientFunds(Exception):
    amount: int
