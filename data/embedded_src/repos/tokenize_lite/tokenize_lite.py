"""Tokenize and evaluate integer arithmetic such as '2 * (3 + 4)'."""

OPERATORS = {"+": 1, "-": 1, "*": 2, "/": 2, "%": 2, "^": 3}
RIGHT_ASSOCIATIVE = {"^"}


class ParseError(Exception):
    pass


def tokenize(text):
    """Split into numbers (as int), operators and parentheses."""
    tokens = []
    i = 0
    while i < len(text):
        char = text[i]
        if char.isspace():
            i += 1
        elif char.isdigit():
            start = i
            while i < len(text) and text[i].isdigit():
                i += 1
            tokens.append(int(text[start:i]))
        elif char in OPERATORS or char in "()":
            tokens.append(char)
            i += 1
        else:
            raise ParseError("unexpected character " + repr(char))
    return tokens


def to_rpn(tokens):
    """Shunting-yard: infix tokens to reverse Polish notation."""
    output = []
    stack = []
    for token in tokens:
        if isinstance(token, int):
            output.append(token)
        elif token == "(":
            stack.append(token)
        elif token == ")":
            while stack and stack[-1] != "(":
                output.append(stack.pop())
            if not stack:
                raise ParseError("unbalanced parentheses")
            stack.pop()
        else:
            while stack and stack[-1] != "(":
                top = stack[-1]
                if OPERATORS[top] > OPERATORS[token]:
                    output.append(stack.pop())
                elif OPERATORS[top] == OPERATORS[token] and token not in RIGHT_ASSOCIATIVE:
                    output.append(stack.pop())
                else:
                    break
            stack.append(token)
    while stack:
        top = stack.pop()
        if top == "(":
            raise ParseError("unbalanced parentheses")
        output.append(top)
    return output


def apply_operator(op, left, right):
    if op == "+":
        return left + right
    if op == "-":
        return left - right
    if op == "*":
        return left * right
    if op == "/":
        if right == 0:
            raise ZeroDivisionError("division by zero")
        return left // right
    if op == "%":
        return left % right
    if op == "^":
        return left ** right
    raise ParseError("unknown operator " + op)


def eval_rpn(items):
    stack = []
    for item in items:
        if isinstance(item, int):
            stack.append(item)
            continue
        if len(stack) < 2:
            raise ParseError("missing operand")
        right = stack.pop()
        left = stack.pop()
        stack.append(apply_operator(item, left, right))
    if len(stack) != 1:
        raise ParseError("malformed expression")
    return stack[0]


def evaluate(text):
    return eval_rpn(to_rpn(tokenize(text)))


def count_numbers(text):
    return sum(1 for token in tokenize(text) if isinstance(token, int))


def max_depth(text):
    """Deepest nesting of parentheses."""
    depth = 0
    deepest = 0
    for char in text:
        if char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth -= 1
    return deepest
