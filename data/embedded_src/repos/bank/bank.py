"""Bank accounts with a transaction history; amounts are whole cents."""


class InsufficientFunds(Exception):
    pass


class Account:
    def __init__(self, owner, balance=0, overdraft=0):
        if balance < 0:
            raise ValueError("opening balance must not be negative")
        self.owner = owner
        self.balance = balance
        self.overdraft = overdraft
        self.history = []

    def deposit(self, amount):
        if amount <= 0:
            raise ValueError("deposit must be positive")
        self.balance += amount
        self.history.append(("deposit", amount))
        return self.balance

    def available(self):
        """What can be withdrawn: balance plus the overdraft limit."""
        return self.balance + self.overdraft

    def withdraw(self, amount):
        if amount <= 0:
            raise ValueError("withdrawal must be positive")
        if amount > self.available():
            raise InsufficientFunds(self.owner)
        self.balance -= amount
        self.history.append(("withdraw", amount))
        return self.balance

    def is_overdrawn(self):
        return self.balance < 0

    def total_deposits(self):
        return sum(amount for kind, amount in self.history if kind == "deposit")

    def total_withdrawals(self):
        return sum(amount for kind, amount in self.history if kind == "withdraw")

    def add_interest(self, rate_percent):
        """Add interest on a positive balance, rounded down to whole cents."""
        if self.balance <= 0:
            return 0
        interest = self.balance * rate_percent // 100
        if interest > 0:
            self.deposit(interest)
        return interest

    def statement(self):
        lines = ["Statement for " + self.owner]
        for kind, amount in self.history:
            sign = "+" if kind == "deposit" else "-"
            lines.append("%s%d" % (sign, amount))
        lines.append("Balance: %d" % self.balance)
        return "\n".join(lines)


def transfer(source, target, amount):
    """Move money between accounts; nothing changes when the source cannot pay."""
    if source is target:
        raise ValueError("cannot transfer to the same account")
    source.withdraw(amount)
    target.deposit(amount)


def richest(accounts):
    """Owner with the highest balance; the first one wins a tie."""
    if not accounts:
        return None
    best = accounts[0]
    for account in accounts[1:]:
        if account.balance > best.balance:
            best = account
    return best.owner


def total_balance(accounts):
    total = 0
    for account in accounts:
        total += account.balance
    return total


def monthly_fee(account, fee=500, free_above=100000):
    """Charge a fee unless the balance is at least free_above; returns the fee charged."""
    if account.balance >= free_above:
        return 0
    account.balance -= fee
    account.history.append(("fee", fee))
    return fee
