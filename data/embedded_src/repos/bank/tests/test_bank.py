import pytest

from bank import Account, InsufficientFunds, monthly_fee, richest, total_balance, transfer


def test_opening_balance():
    assert Account("ann", 100).balance == 100


def test_negative_opening_raises():
    with pytest.raises(ValueError):
        Account("ann", -1)


def test_deposit():
    acc = Account("ann", 100)
    assert acc.deposit(50) == 150


def test_deposit_zero_raises():
    with pytest.raises(ValueError):
        Account("ann").deposit(0)


def test_withdraw():
    acc = Account("ann", 100)
    assert acc.withdraw(30) == 70


def test_withdraw_everything():
    acc = Account("ann", 100)
    assert acc.withdraw(100) == 0


def test_withdraw_too_much():
    with pytest.raises(InsufficientFunds):
        Account("ann", 100).withdraw(101)


def test_withdraw_negative_raises():
    with pytest.raises(ValueError):
        Account("ann", 100).withdraw(-5)


def test_overdraft_allows():
    acc = Account("ann", 100, overdraft=50)
    assert acc.withdraw(150) == -50


def test_available():
    assert Account("ann", 100, overdraft=50).available() == 150


def test_is_overdrawn():
    acc = Account("ann", 10, overdraft=50)
    acc.withdraw(20)
    assert acc.is_overdrawn()


def test_not_overdrawn_at_zero():
    acc = Account("ann", 10)
    acc.withdraw(10)
    assert not acc.is_overdrawn()


def test_history():
    acc = Account("ann")
    acc.deposit(5)
    acc.withdraw(2)
    assert acc.history == [("deposit", 5), ("withdraw", 2)]


def test_totals():
    acc = Account("ann")
    acc.deposit(5)
    acc.deposit(7)
    acc.withdraw(2)
    assert acc.total_deposits() == 12
    assert acc.total_withdrawals() == 2


def test_interest():
    acc = Account("ann", 1000)
    assert acc.add_interest(5) == 50
    assert acc.balance == 1050


def test_interest_rounds_down():
    acc = Account("ann", 199)
    assert acc.add_interest(1) == 1


def test_interest_none_when_empty():
    acc = Account("ann", 0)
    assert acc.add_interest(5) == 0
    assert acc.history == []


def test_statement():
    acc = Account("ann")
    acc.deposit(10)
    acc.withdraw(3)
    assert acc.statement() == "Statement for ann\n+10\n-3\nBalance: 7"


def test_transfer():
    a, b = Account("a", 100), Account("b", 0)
    transfer(a, b, 40)
    assert (a.balance, b.balance) == (60, 40)


def test_transfer_insufficient_keeps_target():
    a, b = Account("a", 10), Account("b", 0)
    with pytest.raises(InsufficientFunds):
        transfer(a, b, 40)
    assert b.balance == 0


def test_transfer_same_account():
    a = Account("a", 10)
    with pytest.raises(ValueError):
        transfer(a, a, 5)


def test_richest():
    assert richest([Account("a", 5), Account("b", 9), Account("c", 7)]) == "b"


def test_richest_tie_first():
    assert richest([Account("a", 9), Account("b", 9)]) == "a"


def test_richest_empty():
    assert richest([]) is None


def test_total_balance():
    assert total_balance([Account("a", 5), Account("b", 9)]) == 14


def test_monthly_fee_charged():
    acc = Account("a", 1000)
    assert monthly_fee(acc) == 500
    assert acc.balance == 500


def test_monthly_fee_free_at_threshold():
    acc = Account("a", 100000)
    assert monthly_fee(acc) == 0
