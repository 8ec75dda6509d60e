from decimal import Decimal

MAX_BALANCE = 100


class InsufficientFunds(Exception):
    pass


class Account:
    def __init__(self, owner: str, balance: Decimal = Decimal(0)) -> None:
        self.owner = owner
        self.balance = balance

    def deposit(self, amount: Decimal) -> Decimal:
        return amount

    def withdraw(self, amount: Decimal, *, note: str | None = None) -> Decimal:
        return amount


def open_acount(owner: str) -> Account:
    return Account(owner)
