"""Small dense matrices stored as lists of rows."""


class Matrix:
    def __init__(self, rows):
        if not rows or not rows[0]:
            raise ValueError("a matrix needs at least one row and one column")
        width = len(rows[0])
        for row in rows:
            if len(row) != width:
                raise ValueError("rows must have equal length")
        self.rows = [list(row) for row in rows]

    @property
    def shape(self):
        return (len(self.rows), len(self.rows[0]))

    def __eq__(self, other):
        return isinstance(other, Matrix) and self.rows == other.rows

    def __repr__(self):
        return "Matrix(%r)" % (self.rows,)

    def get(self, i, j):
        return self.rows[i][j]

    def add(self, other):
        if self.shape != other.shape:
            raise ValueError("shapes differ")
        n, m = self.shape
        return Matrix([[self.rows[i][j] + other.rows[i][j] for j in range(m)] for i in range(n)])

    def subtract(self, other):
        if self.shape != other.shape:
            raise ValueError("shapes differ")
        n, m = self.shape
        return Matrix([[self.rows[i][j] - other.rows[i][j] for j in range(m)] for i in range(n)])

    def scale(self, factor):
        return Matrix([[value * factor for value in row] for row in self.rows])

    def transpose(self):
        n, m = self.shape
        return Matrix([[self.rows[i][j] for i in range(n)] for j in range(m)])

    def multiply(self, other):
        n, k = self.shape
        k2, m = other.shape
        if k != k2:
            raise ValueError("inner dimensions differ")
        result = []
        for i in range(n):
            row = []
            for j in range(m):
                total = 0
                for t in range(k):
                    total += self.rows[i][t] * other.rows[t][j]
                row.append(total)
            result.append(row)
        return Matrix(result)

    def trace(self):
        n, m = self.shape
        if n != m:
            raise ValueError("trace needs a square matrix")
        return sum(self.rows[i][i] for i in range(n))

    def is_square(self):
        n, m = self.shape
        return n == m

    def determinant(self):
        """Determinant by expansion along the first row."""
        n, m = self.shape
        if n != m:
            raise ValueError("determinant needs a square matrix")
        if n == 1:
            return self.rows[0][0]
        if n == 2:
            return self.rows[0][0] * self.rows[1][1] - self.rows[0][1] * self.rows[1][0]
        total = 0
        for j in range(n):
            sign = 1 if j % 2 == 0 else -1
            total += sign * self.rows[0][j] * self.minor(0, j).determinant()
        return total

    def minor(self, i, j):
        """The matrix without row i and column j."""
        return Matrix([row[:j] + row[j + 1:] for k, row in enumerate(self.rows) if k != i])


def identity(n):
    return Matrix([[1 if i == j else 0 for j in range(n)] for i in range(n)])


def zeros(n, m):
    return Matrix([[0] * m for _ in range(n)])


def power(matrix, exponent):
    """matrix ** exponent for a square matrix and exponent >= 0."""
    if exponent < 0:
        raise ValueError("negative exponent")
    result = identity(matrix.shape[0])
    for _ in range(exponent):
        result = result.multiply(matrix)
    return result
