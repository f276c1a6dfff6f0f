"""A small declarative checker for the recipe front matter: keys, types, choices and ranges.

Every problem is a ``ValueError`` that names the recipe, the dotted key, the value and what is
allowed (and, for an unknown key, every valid key of that section), so a typo in a card is found
when the card is loaded, not hours into a run.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["REQUIRED", "Key", "check_section", "fail"]


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()

_TYPE_WORDS = {
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "mapping": "a mapping",
    "list[str]": "a list of strings",
}


@dataclass(frozen=True)
class Key:
    """One key of a section.

    Attributes:
        name: the key.
        kind: ``str``, ``int``, ``float``, ``bool``, ``mapping`` or ``list[str]``.
        default: the value when the key is absent; ``REQUIRED`` makes it mandatory.
        nullable: whether ``null`` is allowed.
        choices: the allowed values, if restricted.
        minimum, maximum: inclusive bounds for numbers; ``above`` makes the minimum exclusive,
            ``below`` the maximum.
    """

    name: str
    kind: str
    default: Any = REQUIRED
    nullable: bool = False
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    above: bool = False
    below: bool = False

    def allowed(self) -> str:
        if self.choices is not None:
            text = "one of " + ", ".join(repr(c) for c in self.choices)
        else:
            text = _TYPE_WORDS[self.kind]
            if self.minimum is not None:
                text += f" {'>' if self.above else '>='} {self.minimum:g}"
            if self.maximum is not None:
                text += f"{',' if self.minimum is not None else ''} {'<' if self.below else '<='} {self.maximum:g}"
        return text + (" or null" if self.nullable else "")


def fail(where: str, path: str, value: Any, allowed: str) -> None:
    """Raise the standard error: ``<where>: <path>=<value>: must be <allowed>``."""
    raise ValueError(f"{where}: {path}={value!r}: must be {allowed}")


def _yaml_hint(key: Key, value: Any) -> str:
    if key.kind == "float" and isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return ""
        return " (YAML reads 1e-3 as a string: write 1.0e-3)"
    if key.kind == "str" and isinstance(value, bool):
        return " (YAML reads no/yes/off/on as booleans: quote it, e.g. 'no')"
    return ""


def _check_value(where: str, path: str, key: Key, value: Any) -> Any:
    if value is None:
        if not key.nullable:
            fail(where, path, value, key.allowed())
        return None
    kind = key.kind
    ok = (
        (kind == "str" and isinstance(value, str))
        or (kind == "int" and isinstance(value, int) and not isinstance(value, bool))
        or (kind == "float" and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (kind == "bool" and isinstance(value, bool))
        or (kind == "mapping" and isinstance(value, Mapping) and all(isinstance(k, str) for k in value))
        or (kind == "list[str]" and isinstance(value, list) and all(isinstance(v, str) for v in value))
    )
    if not ok:
        fail(where, path, value, key.allowed() + _yaml_hint(key, value))
    if kind == "float":
        value = float(value)
    elif kind == "mapping":
        value = dict(value)
    elif kind == "list[str]":
        value = tuple(value)
    if key.choices is not None and value not in key.choices:
        fail(where, path, value, key.allowed())
    if key.minimum is not None and (value < key.minimum or (key.above and value == key.minimum)):
        fail(where, path, value, key.allowed())
    if key.maximum is not None and (value > key.maximum or (key.below and value == key.maximum)):
        fail(where, path, value, key.allowed())
    return value


def check_section(where: str, path: str, data: Any, keys: Sequence[Key]) -> dict[str, Any]:
    """Check the mapping ``data`` (the section at dotted ``path``) against ``keys``.

    Returns:
        the checked values with defaults filled in, in the order of ``keys``.

    Raises:
        ValueError: not a mapping, an unknown or missing key, a wrong type, a value out of range.
    """
    prefix = f"{path}." if path else ""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: {path or 'the front matter'} must be a mapping of keys, got {type(data).__name__}")
    known = [k.name for k in keys]
    for name in data:
        if name not in known:
            raise ValueError(f"{where}: unknown key {prefix}{name}; valid keys of {path or 'the front matter'}: {', '.join(known)}")
    result: dict[str, Any] = {}
    for key in keys:
        if key.name not in data:
            if key.default is REQUIRED:
                raise ValueError(f"{where}: missing key {prefix}{key.name} ({key.allowed()})")
            result[key.name] = copy.deepcopy(key.default)  # never share a mutable default
            continue
        result[key.name] = _check_value(where, f"{prefix}{key.name}", key, data[key.name])
    return result
