import pytest

from inventory import Inventory, OutOfStock, format_cents


def make():
    inv = Inventory(low_stock_level=3)
    inv.add_item("apple", 10, 50)
    inv.add_item("pear", 2, 80)
    return inv


def test_add_and_quantity():
    assert make().quantity("apple") == 10


def test_unknown_quantity_zero():
    assert make().quantity("kiwi") == 0


def test_add_existing_increases():
    inv = make()
    inv.add_item("apple", 5, 0)
    assert inv.quantity("apple") == 15


def test_add_existing_keeps_price_when_zero():
    inv = make()
    inv.add_item("apple", 1, 0)
    assert inv.price("apple") == 50


def test_add_existing_new_price():
    inv = make()
    inv.add_item("apple", 1, 60)
    assert inv.price("apple") == 60


def test_add_zero_quantity_raises():
    with pytest.raises(ValueError):
        make().add_item("kiwi", 0, 10)


def test_add_negative_price_raises():
    with pytest.raises(ValueError):
        make().add_item("kiwi", 1, -1)


def test_free_item_allowed():
    inv = Inventory()
    inv.add_item("flyer", 3, 0)
    assert inv.price("flyer") == 0


def test_remove():
    inv = make()
    inv.remove_item("apple", 4)
    assert inv.quantity("apple") == 6


def test_remove_all_deletes():
    inv = make()
    inv.remove_item("pear", 2)
    assert "pear" not in inv.items


def test_remove_too_many():
    with pytest.raises(OutOfStock):
        make().remove_item("pear", 3)


def test_remove_unknown():
    with pytest.raises(KeyError):
        make().remove_item("kiwi", 1)


def test_item_value():
    assert make().item_value("pear") == 160


def test_total_value():
    assert make().total_value() == 660


def test_total_value_empty():
    assert Inventory().total_value() == 0


def test_total_units():
    assert make().total_units() == 12


def test_low_stock():
    assert make().low_stock() == ["pear"]


def test_low_stock_boundary():
    inv = make()
    inv.add_item("fig", 3, 10)
    assert inv.low_stock() == ["fig", "pear"]


def test_most_valuable():
    assert make().most_valuable() == "apple"


def test_most_valuable_empty():
    assert Inventory().most_valuable() is None


def test_most_valuable_tie_alphabetical():
    inv = Inventory()
    inv.add_item("b", 1, 10)
    inv.add_item("a", 2, 5)
    assert inv.most_valuable() == "a"


def test_restock_plan():
    assert make().restock_plan(5) == {"pear": 3}


def test_restock_plan_nothing():
    assert make().restock_plan(2) == {}


def test_discount():
    inv = make()
    inv.apply_discount(10)
    assert inv.price("pear") == 72


def test_discount_rounds_down():
    inv = Inventory()
    inv.add_item("x", 1, 99)
    inv.apply_discount(50)
    assert inv.price("x") == 49


def test_discount_bad_percent():
    with pytest.raises(ValueError):
        make().apply_discount(120)


def test_format_cents():
    assert format_cents(1234) == "12.34"


def test_format_cents_padding():
    assert format_cents(105) == "1.05"
