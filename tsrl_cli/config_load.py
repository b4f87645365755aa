"""How config.py's frozen dataclasses are read: nested overrides (an experiment YAML, `--set a.b=c` items,
flags) merged strictly, each leaf checked against its annotation (Literal choices included), with errors
(ConfigError, exit 2) naming the key and the valid ones; and each field's comments in the source, its help.
Callers import these names from tsrl_cli.config, which defines the training config on top.
"""

from __future__ import annotations

import difflib
import inspect
import io
import math
import textwrap
import tokenize
import types
import typing
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml

from tsrl_cli.errors import UsageError


class ConfigError(UsageError):
    """An unknown key, a wrong type or an invalid value in the config. Exit 2."""


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)  # extras: a LossConfig choice is Annotated[str, Literal]


def choices(cls, name: str) -> tuple[str, ...]:
    """The names field `name` of dataclass `cls` accepts (its Literal, or Annotated[str, Literal]); () if free."""
    tp = _hints(cls)[name]
    if typing.get_origin(tp) is Annotated:
        tp = next((m for m in tp.__metadata__ if typing.get_origin(m) is Literal), None)
    return get_args(tp) if typing.get_origin(tp) is Literal else ()


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check one leaf value against its annotation; lists become tuples; ints are accepted as floats."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        value = coerce(value, tp.__origin__, key)
        return next((coerce(value, m, key) for m in tp.__metadata__ if typing.get_origin(m) is Literal), value)
    if origin is Literal:
        if isinstance(value, bool) and {"on", "off"} <= set(get_args(tp)):
            value = "on" if value else "off"  # YAML 1.1 (PyYAML) reads an unquoted on / off as true / false
        if isinstance(value, str) and value in get_args(tp):
            return value
        raise ConfigError(f"config key {key}: {value!r} is not one of {', '.join(get_args(tp))}")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"config key {key}: bad value {value!r}")
    if origin is tuple:  # an item's error names the list's key: the message quotes the item
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key {key}: expected a list, got {value!r} "
                              f"(YAML list syntax: --set '{key}=[a,b]')")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(v, args[0], key) for v in value)
        if len(value) != len(args):
            raise ConfigError(f"config key {key}: expected a list of {len(args)} values, got {len(value)}")
        return tuple(coerce(v, a, key) for v, a in zip(value, args, strict=True))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key {key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"config key {key}: expected an integer, got {value!r}")
    if tp is float:
        # PyYAML (YAML 1.1) reads 1e-3 as a string (it needs "1.0e-3"), so numeric strings count too
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            try:
                number = float(value)
            except (ValueError, OverflowError):
                number = None
            if number is not None and math.isfinite(number):
                return number
        raise ConfigError(f"config key {key}: expected a finite number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"config key {key}: expected a string, got {value!r}")
    raise ConfigError(f"config key {key}: unsupported type {getattr(tp, '__name__', tp)}")


def _unknown(key: str, name: str, valid: list[str]) -> ConfigError:
    near = difflib.get_close_matches(name, valid, n=1)
    hint = f"; did you mean {near[0]}?" if near else ""
    return ConfigError(f"unknown config key {key!r}{hint} (valid here: {', '.join(valid)})")


def merge(obj, overrides: dict, prefix: str = ""):
    """A copy of dataclass `obj` with the nested `overrides` applied, strictly checked."""
    if not isinstance(overrides, dict):
        raise ConfigError(f"config key {prefix.rstrip('.') or '<root>'}: expected a mapping, got {overrides!r}")
    hints = _hints(type(obj))
    valid = [f.name for f in fields(obj)]
    changes = {}
    for name, value in overrides.items():
        key = prefix + str(name)
        if name not in hints:
            raise _unknown(key, str(name), valid)
        current = getattr(obj, name)
        if is_dataclass(current):
            changes[name] = merge(current, value, key + ".")
        else:
            changes[name] = coerce(value, hints[name], key)
    return replace(obj, **changes)


def check_leaves(obj, prefix: str = "") -> None:
    """Every leaf of dataclass `obj` against its annotation, as merge checks an override (for a config made
    in code, with dataclasses.replace)."""
    for name, tp in _hints(type(obj)).items():
        value = getattr(obj, name)
        if is_dataclass(value):
            check_leaves(value, f"{prefix}{name}.")
        else:
            coerce(value, tp, prefix + name)


def parse_set(item: str) -> dict:
    """'a.b=c' -> {'a': {'b': <c parsed as YAML>}}; the value is a YAML scalar or list."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value (e.g. --set rollout.group_size=4)")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return nested(key, value)


def nested(key: str, value: Any) -> dict:
    """'a.b.c', v -> {'a': {'b': {'c': v}}}."""
    out: dict = {}
    node = out
    parts = key.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return out


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: experiment file not found")
    try:
        doc = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        first = str(e).strip().splitlines()[0]
        raise ConfigError(f"{p}: not valid YAML ({first})") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{p}: an experiment file is a mapping of config keys")
    return doc


def field_help(cls) -> dict[str, str]:
    """Each field of dataclass `cls` -> its comments in the source: the full-line comments right above
    it, then the one closing its line ('' for none). `tsrl verify` shows a LossConfig field's comments
    as its option's help: the comment beside a field is its documentation."""
    names = {f.name for f in fields(cls)}
    above: dict[int, str] = {}  # row -> a comment alone on its line
    after: dict[int, str] = {}  # row -> the comment closing a line of code
    rows: dict[str, int] = {}  # field -> the row it is declared on
    prev = None
    for tok in tokenize.generate_tokens(io.StringIO(textwrap.dedent(inspect.getsource(cls))).readline):
        starts_line = not tok.line[: tok.start[1]].strip()
        if tok.type == tokenize.COMMENT:
            (above if starts_line else after)[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.string == ":" and prev is not None and prev.type == tokenize.NAME and prev.string in names \
                and not prev.line[: prev.start[1]].strip():  # `name: type = default` at the start of a line
            rows.setdefault(prev.string, prev.start[0])
        if tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT):
            prev = tok
    out = {}
    for name, row in rows.items():
        block, r = [], row - 1
        while r in above:
            block.insert(0, above[r])
            r -= 1
        out[name] = "; ".join(part for part in (" ".join(block), after.get(row, "")) if part)
    return out
