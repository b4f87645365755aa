"""A shop inventory: items with quantity and unit price (in cents)."""


class OutOfStock(Exception):
    pass


class Inventory:
    def __init__(self, low_stock_level=5):
        self.items = {}
        self.low_stock_level = low_stock_level

    def add_item(self, name, quantity, price):
        """Add stock; a known item keeps its price unless a new positive one is given."""
        if quantity <= 0:
            raise ValueError("quantity must be positive")
        if price < 0:
            raise ValueError("price must not be negative")
        if name in self.items:
            self.items[name]["quantity"] += quantity
            if price > 0:
                self.items[name]["price"] = price
        else:
            self.items[name] = {"quantity": quantity, "price": price}

    def remove_item(self, name, quantity):
        if name not in self.items:
            raise KeyError(name)
        available = self.items[name]["quantity"]
        if quantity > available:
            raise OutOfStock(name)
        self.items[name]["quantity"] = available - quantity
        if self.items[name]["quantity"] == 0:
            del self.items[name]

    def quantity(self, name):
        if name not in self.items:
            return 0
        return self.items[name]["quantity"]

    def price(self, name):
        return self.items[name]["price"]

    def item_value(self, name):
        return self.quantity(name) * self.price(name)

    def total_value(self):
        total = 0
        for name in self.items:
            total += self.item_value(name)
        return total

    def total_units(self):
        return sum(entry["quantity"] for entry in self.items.values())

    def low_stock(self):
        """Names with quantity at or below the low stock level, sorted."""
        names = []
        for name, entry in self.items.items():
            if entry["quantity"] <= self.low_stock_level:
                names.append(name)
        return sorted(names)

    def most_valuable(self):
        """The item with the highest stock value; None when empty."""
        best = None
        best_value = -1
        for name in sorted(self.items):
            value = self.item_value(name)
            if value > best_value:
                best = name
                best_value = value
        return best

    def restock_plan(self, target):
        """Units to order per item to bring every item up to target."""
        plan = {}
        for name in sorted(self.items):
            missing = target - self.items[name]["quantity"]
            if missing > 0:
                plan[name] = missing
        return plan

    def apply_discount(self, percent):
        """Lower every price by percent, rounding down to whole cents."""
        if percent < 0 or percent > 100:
            raise ValueError("percent must be between 0 and 100")
        for entry in self.items.values():
            entry["price"] = entry["price"] * (100 - percent) // 100


def format_cents(cents):
    return "%d.%02d" % (cents // 100, cents % 100)
