"""Accounts, with helpers the contract does not mention."""
from decimal import Decimal
import logging

log = logging.getLogger(__name__)

# The ceiling, in cents.
MAX_BALANCE = 10**8


def _check(amount):  # a helper
    if amount <= 0:
        raise ValueError(amount)
    return amount


class InsufficientFunds(Exception):
    """Raised when a withdrawal exceeds the balance."""


class _Audit:
    entries = []


class Account:
    """An account."""

    # Comments between members are fine.
    def __init__(self, owner: str, balance: Decimal = Decimal("0")) -> None:
        """Open it."""
        self.owner = owner
        self.balance = balance

    def deposit(self, amount: Decimal) -> Decimal:  # trailing comment
        self.balance += _check(amount)
        log.info("deposit %s", amount)
        return self.balance

    def withdraw(
        self,
        amount: Decimal,  # how much
        *,
        note: str | None = None,
    ) -> Decimal:
        _Audit.entries.append(note)
        self.balance -= _check(amount)
        return self.balance

    def _private(self):
        return None


def open_account(owner: str) -> Account:
    return Account(owner)
