import pytest

from tokenize_lite import ParseError, apply_operator, count_numbers, eval_rpn, evaluate, max_depth, to_rpn, tokenize


def test_tokenize_numbers():
    assert tokenize("12 + 3") == [12, "+", 3]


def test_tokenize_no_spaces():
    assert tokenize("2*(3+4)") == [2, "*", "(", 3, "+", 4, ")"]


def test_tokenize_multi_digit():
    assert tokenize("1234") == [1234]


def test_tokenize_bad_char():
    with pytest.raises(ParseError):
        tokenize("2 & 3")


def test_tokenize_empty():
    assert tokenize("   ") == []


def test_rpn_precedence():
    assert to_rpn([1, "+", 2, "*", 3]) == [1, 2, 3, "*", "+"]


def test_rpn_left_assoc():
    assert to_rpn([8, "-", 3, "-", 2]) == [8, 3, "-", 2, "-"]


def test_rpn_right_assoc_power():
    assert to_rpn([2, "^", 3, "^", 2]) == [2, 3, 2, "^", "^"]


def test_rpn_parentheses():
    assert to_rpn([2, "*", "(", 3, "+", 4, ")"]) == [2, 3, 4, "+", "*"]


def test_rpn_unbalanced_close():
    with pytest.raises(ParseError):
        to_rpn([1, ")"])


def test_rpn_unbalanced_open():
    with pytest.raises(ParseError):
        to_rpn(["(", 1])


def test_apply_add():
    assert apply_operator("+", 2, 3) == 5


def test_apply_sub():
    assert apply_operator("-", 2, 3) == -1


def test_apply_mul():
    assert apply_operator("*", 4, 3) == 12


def test_apply_div_floors():
    assert apply_operator("/", 7, 2) == 3


def test_apply_div_zero():
    with pytest.raises(ZeroDivisionError):
        apply_operator("/", 1, 0)


def test_apply_mod():
    assert apply_operator("%", 7, 3) == 1


def test_apply_pow():
    assert apply_operator("^", 2, 5) == 32


def test_apply_unknown():
    with pytest.raises(ParseError):
        apply_operator("?", 1, 2)


def test_eval_rpn():
    assert eval_rpn([2, 3, "+", 4, "*"]) == 20


def test_eval_rpn_missing_operand():
    with pytest.raises(ParseError):
        eval_rpn([1, "+"])


def test_eval_rpn_extra_operand():
    with pytest.raises(ParseError):
        eval_rpn([1, 2])


def test_evaluate_precedence():
    assert evaluate("2 + 3 * 4") == 14


def test_evaluate_parentheses():
    assert evaluate("(2 + 3) * 4") == 20


def test_evaluate_subtraction_chain():
    assert evaluate("10 - 4 - 3") == 3


def test_evaluate_division_chain():
    assert evaluate("100 / 10 / 5") == 2


def test_evaluate_power():
    assert evaluate("2 ^ 3 ^ 2") == 512


def test_evaluate_mod():
    assert evaluate("17 % 5 + 1") == 3


def test_count_numbers():
    assert count_numbers("1 + 22 * (333 - 4)") == 4


def test_max_depth():
    assert max_depth("((1 + 2) * (3))") == 2


def test_max_depth_flat():
    assert max_depth("1 + 2") == 0
