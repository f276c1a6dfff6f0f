"""The settings core: truth words, typed text, and the structured error every bad setting raises.

This module and :mod:`._kinds` are the bottom of qaccel: they import the standard library only
(no Accelerate, nothing of qaccel's), so every layer above may use them. Truth words are Accelerate's
(``accelerate.utils.str_to_bool``, the parser behind ``accelerate launch``'s environment flags),
listed here once; ``tests/unit/test_settings_core.py`` checks them against Accelerate word for word.
"""

from __future__ import annotations

import os
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

# What accelerate.utils.str_to_bool accepts (accelerate/utils/environment.py), compared after
# strip() and lower(); the short y/t/n/f are listed last since nobody should write them on purpose.
TRUE_WORDS = ("1", "true", "on", "yes", "y", "t")
FALSE_WORDS = ("0", "false", "off", "no", "n", "f")
BOOL_WORDS = (*TRUE_WORDS[:4], *FALSE_WORDS[:4], "y", "t", "n", "f")
BOOL_ALLOWED = f"True/False or one of {', '.join(BOOL_WORDS[:8])} (any case; also {', '.join(BOOL_WORDS[8:])})"
# Spellings of None in text for an ``X | None`` field read by type (parse_text).
NONE_WORDS = ("none", "null")


class _Unshown:
    def __repr__(self) -> str:
        return "<unshown>"


#: ``value`` of a :class:`SettingProblem` whose message names the setting but not its value.
UNSHOWN: Any = _Unshown()


class SettingProblem(Exception):
    """A bad value of one setting: who owns it, its key, the value, what is allowed, where it came from.

    Raised as one of the concrete classes below (a ``ValueError``, ``TypeError`` or
    ``NotImplementedError``, as the house rules ask), so callers catch what they always caught; the
    settings reader catches :class:`SettingProblem` and adds the source of the value by key
    (:meth:`with_source`), never by reading the message.

    ``str()`` reads ``"<owner>.<key>=<value!r> (from <source>): <allowed>"`` when the source was
    known where the text was read (the value is that text), and
    ``"<owner>.<key>=<value!r>: <allowed> (from <source>)"`` when it was added afterwards.

    Args:
        key: the setting (a field name, or an environment variable when there is no owner).
        value: the value as given, or :data:`UNSHOWN` for a rule about the setting as a whole.
        allowed: the rest of the message: what is wrong and what is allowed.
        owner: the config class name, or ``""``.
        source: where the text came from (an environment variable, a file and key), if known.
        together_with: other settings the rule involves, shown after the value
            (``"weight_rotation='hadamard'"``).
    """

    def __init__(
        self,
        key: str,
        value: Any = UNSHOWN,
        allowed: str = "",
        *,
        owner: str = "",
        source: str | None = None,
        together_with: str = "",
    ) -> None:
        self.key, self.value, self.allowed, self.owner = key, value, allowed, owner
        self.source, self.together_with = source, together_with
        self.source_is_text = source is not None  # the value is text read from `source`
        super().__init__(key, value, allowed)

    def with_source(self, source: str) -> SettingProblem:
        """The same problem, naming ``source`` (where the value entered) at the end of the message."""
        copy = type(self)(self.key, self.value, self.allowed, owner=self.owner, together_with=self.together_with)
        copy.source = source
        return copy

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.key, self.value, self.allowed), self.__dict__)

    def __str__(self) -> str:
        subject = f"{self.owner}.{self.key}" if self.owner else self.key
        if self.value is not UNSHOWN:
            subject += f"={self.value!r}"
        if self.together_with:
            subject += f" with {self.together_with}"
        where = f" (from {self.source})" if self.source else ""
        if self.source_is_text:
            return f"{subject}{where}: {self.allowed}"
        return f"{subject}: {self.allowed}{where}"


class SettingError(SettingProblem, ValueError):
    """A setting's value is outside what is allowed (bad text, out of range, not a choice)."""


class SettingTypeError(SettingProblem, TypeError):
    """A setting's value has the wrong type (a bool for a bit width, a float for an int)."""


class UnsupportedSetting(SettingProblem, NotImplementedError):
    """A setting's value is valid but not supported (a DeepSpeed key's other value)."""


def parse_bool(value: Any, *, key: str, source: str | None = None, owner: str = "") -> bool:
    """A truth value: ``True``/``False``, the ints 0/1, or a word ``str_to_bool`` accepts (any case).

    Args:
        value: the value as given (code, file or environment).
        key: what it sets, for the message (``"prefetch"`` with ``owner="QSDPConfig"``, or ``"HF_HUB_OFFLINE"``).
        source: where it came from (an environment variable, a file and key), if not code.
        owner: the config class, if any.

    Returns:
        The bool.

    Raises:
        SettingError: anything else (a ``ValueError``), naming the key, the value, the allowed words
            and the source.

    Example::

        parse_bool(" Yes ", key="QSDPConfig.prefetch")  # True
    """
    if isinstance(value, bool):
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in TRUE_WORDS or word in FALSE_WORDS:
            return word in TRUE_WORDS
    raise SettingError(key, value, f"not a boolean; must be {BOOL_ALLOWED}", owner=owner, source=source)


def env_flag(name: str, environ: Mapping[str, str] | None = None, *, default: bool = False) -> bool:
    """The truth value of the environment variable ``name``; unset or blank gives ``default``.

    Raises:
        ValueError: a value that is no truth value (as Accelerate's ``parse_flag_from_env`` does).
    """
    value = (os.environ if environ is None else environ).get(name, "")
    return parse_bool(value, key=name) if value.strip() else default


def parse_text(text: str, kind: Any, *, key: str, source: str | None = None, owner: str = "") -> Any:
    """Turn ``text`` (an environment variable, a flag) into a value of the field type ``kind``.

    Handles ``bool``, ``int``, ``float``, ``str``, ``Literal[...]``, ``X | None`` (``none``/``null``
    give ``None``) and ``tuple[X, ...]`` / ``tuple[X, Y]`` (comma-separated, brackets optional).

    Raises:
        SettingError: text that is no value of ``kind`` (a ``ValueError``), naming the key, the text
            and the source.
        TypeError: a field type this reader does not handle (a bug in the config class).
    """
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    stripped = text.strip()
    name = f"{owner}.{key}" if owner else key

    def refuse(allowed: str) -> SettingError:
        return SettingError(key, text, allowed, owner=owner, source=source)

    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        if len(members) != 1:
            raise TypeError(f"{name}: cannot read text into {kind} (only X | None unions are supported)")
        if type(None) in args and stripped.lower() in NONE_WORDS:
            return None
        return parse_text(text, members[0], key=key, source=source, owner=owner)
    if kind is bool:
        return parse_bool(text, key=key, source=source, owner=owner)
    if kind in (int, float):
        try:
            return kind(stripped)
        except ValueError:
            raise refuse("not an int" if kind is int else "not a number") from None
    if kind is str:
        return stripped
    if origin is Literal:
        for choice in args:
            if stripped == str(choice):
                return choice
        raise refuse(f"must be one of {', '.join(map(str, args))}")
    if origin is tuple:
        parts = [p.strip() for p in re.sub(r"[()\[\]]", "", stripped).split(",") if p.strip()]
        kinds = [args[0]] * len(parts) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(parts) != len(kinds):
            names = ", ".join(k.__name__ for k in kinds)
            raise refuse(f"must be {len(kinds)} comma-separated values ({names})")
        return tuple(parse_text(p, k, key=key, source=source, owner=owner) for p, k in zip(parts, kinds, strict=True))
    raise TypeError(f"{name}: cannot read text into {kind}")
