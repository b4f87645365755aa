import pytest

from matrix2d import Matrix, identity, power, zeros


def test_empty_matrix_raises():
    with pytest.raises(ValueError):
        Matrix([])


def test_ragged_raises():
    with pytest.raises(ValueError):
        Matrix([[1, 2], [3]])


def test_shape():
    assert Matrix([[1, 2, 3], [4, 5, 6]]).shape == (2, 3)


def test_get():
    assert Matrix([[1, 2], [3, 4]]).get(1, 0) == 3


def test_add():
    assert Matrix([[1, 2]]).add(Matrix([[3, 4]])) == Matrix([[4, 6]])


def test_add_shape_mismatch():
    with pytest.raises(ValueError):
        Matrix([[1, 2]]).add(Matrix([[1], [2]]))


def test_subtract():
    assert Matrix([[5, 5]]).subtract(Matrix([[1, 2]])) == Matrix([[4, 3]])


def test_subtract_shape_mismatch():
    with pytest.raises(ValueError):
        Matrix([[1, 2]]).subtract(Matrix([[1]]))


def test_scale():
    assert Matrix([[1, -2]]).scale(3) == Matrix([[3, -6]])


def test_transpose():
    assert Matrix([[1, 2, 3]]).transpose() == Matrix([[1], [2], [3]])


def test_transpose_square():
    assert Matrix([[1, 2], [3, 4]]).transpose() == Matrix([[1, 3], [2, 4]])


def test_multiply():
    a = Matrix([[1, 2], [3, 4]])
    b = Matrix([[5, 6], [7, 8]])
    assert a.multiply(b) == Matrix([[19, 22], [43, 50]])


def test_multiply_rectangular():
    a = Matrix([[1, 2, 3]])
    b = Matrix([[1], [1], [1]])
    assert a.multiply(b) == Matrix([[6]])


def test_multiply_mismatch():
    with pytest.raises(ValueError):
        Matrix([[1, 2]]).multiply(Matrix([[1, 2]]))


def test_trace():
    assert Matrix([[1, 2], [3, 4]]).trace() == 5


def test_trace_not_square():
    with pytest.raises(ValueError):
        Matrix([[1, 2]]).trace()


def test_is_square():
    assert Matrix([[1]]).is_square()
    assert not Matrix([[1, 2]]).is_square()


def test_determinant_1x1():
    assert Matrix([[7]]).determinant() == 7


def test_determinant_2x2():
    assert Matrix([[1, 2], [3, 4]]).determinant() == -2


def test_determinant_3x3():
    assert Matrix([[2, 0, 1], [1, 3, 2], [1, 1, 2]]).determinant() == 6


def test_determinant_3x3_second():
    assert Matrix([[1, 2, 3], [0, 1, 4], [5, 6, 0]]).determinant() == 1


def test_determinant_not_square():
    with pytest.raises(ValueError):
        Matrix([[1, 2]]).determinant()


def test_minor():
    m = Matrix([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    assert m.minor(1, 1) == Matrix([[1, 3], [7, 9]])


def test_identity():
    assert identity(2) == Matrix([[1, 0], [0, 1]])


def test_zeros():
    assert zeros(2, 3) == Matrix([[0, 0, 0], [0, 0, 0]])


def test_power_zero():
    assert power(Matrix([[2, 1], [0, 2]]), 0) == identity(2)


def test_power_three():
    assert power(Matrix([[1, 1], [0, 1]]), 3) == Matrix([[1, 3], [0, 1]])


def test_power_negative():
    with pytest.raises(ValueError):
        power(identity(2), -1)


def test_repr():
    assert repr(Matrix([[1]])) == "Matrix([[1]])"
