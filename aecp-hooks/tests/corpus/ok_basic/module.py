from decimal import Decimal

MAX_BALANCE: int = 1_000_000


class InsufficientFunds(Exception):
    pass


class Account:
    def __init__(self, owner: str, balance: Decimal = Decimal(0)) -> None:
        self.owner = owner
        self.balance = balance

    def deposit(self, amount: Decimal) -> Decimal:
        self.balance += amount
        return self.balance

    def withdraw(self, amount: Decimal, *, note: str | None = None) -> Decimal:
        if amount > self.balance:
            raise InsufficientFunds(amount)
        self.balance -= amount
        return self.balance


def open_account(owner: str) -> Account:
    return Account(owner)
