"""Field readers: how one setting's value is read, whatever it entered through (keyword, environment, file, dict).

A config field declares its reader in its metadata (``field(..., metadata={"help": ..., READER:
IntSetting(2, 8, unset=OFF)})``) and the class is built with :func:`settings_dataclass`, whose
``__init__`` passes every keyword through its field's reader before the dataclass stores it. So a
value is normalised once, where it enters: ``QSDPConfig(weight_bits="off")``, ``QACCEL_QSDP_WEIGHT_BITS=off``
and ``weight_bits: off`` in a recipe all store ``None``, and no field changes after ``__init__``.
A field with a reader gets environment and flag text unparsed (the reader reads text); any other
field's text is parsed by its type (:func:`parse_text`).

Part of the settings core: imports the standard library and :mod:`._values` only.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from ._values import BOOL_WORDS, SettingError, SettingTypeError, parse_bool

#: The field-metadata key that holds a field's reader.
READER = "reader"
# Spellings of "this path is off" (bit widths) and "per-bit default" (bucket size, meta dtype),
# compared after strip() and lower(). Both read as None: the field's None means off or auto.
OFF_WORDS = ("off", "none", "false", "32")
AUTO_WORDS = ("auto", "none", "")


@dataclasses.dataclass(frozen=True)
class Unset:
    """The spellings that store ``None`` in a field: ``words`` (text) and ``values`` (matched by type and value)."""

    words: tuple[str, ...]
    values: tuple[Any, ...]
    help: str

    def matches(self, value: Any, text: str | None) -> bool:
        """Whether ``value`` (``text`` when it is a string, stripped and lower-cased) spells ``None``."""
        # type-exact: False switches a path off, 0 is an int to range-check; 32.0 is no spelling of 32
        return text in self.words or any(type(value) is type(u) and value == u for u in self.values)


#: A bit width's "off": None, False, the int 32 (full precision) or one of :data:`OFF_WORDS`.
OFF = Unset(OFF_WORDS, (None, False, 32), "off: None, False, 32 or 'off'/'none'/'false'/'32'")
#: A bucket size's or metadata dtype's "per-bit default": None or one of :data:`AUTO_WORDS`.
AUTO = Unset(AUTO_WORDS, (None,), "auto: the per-bit default")


class FieldReader(Protocol):
    """Reads one field's value as given (any type, or text) into its stored form, or raises a :class:`SettingProblem`."""

    def __call__(self, value: Any, *, owner: str, key: str) -> Any: ...


def _text(value: Any) -> str | None:
    return value.strip().lower() if isinstance(value, str) else None


@dataclasses.dataclass(frozen=True)
class IntSetting:
    """An int in ``[low, high]``; text holding an int (in ``base``; 0: also ``0x..``) is read as that int.

    ``unset`` names the spellings stored as ``None`` (``unset_help`` overrides how the message names them).
    A bool is no int here: ``True`` is YAML's ``on``, not a bit width.
    """

    low: int
    high: int | None = None
    base: int = 10
    unset: Unset | None = None
    unset_help: str | None = None

    def allowed(self) -> str:
        allowed = f"an int in [{self.low}, {self.high}]" if self.high is not None else f"an int >= {self.low}"
        if self.unset is not None:
            allowed += f", or {self.unset_help or self.unset.help}"
        return allowed

    def __call__(self, value: Any, *, owner: str, key: str) -> int | None:
        text = _text(value)
        if self.unset is not None and self.unset.matches(value, text):
            return None
        if text is not None:
            try:
                value = int(text, self.base)
            except ValueError:  # no number and no keyword
                raise SettingError(key, value, f"must be {self.allowed()}", owner=owner) from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise SettingTypeError(key, value, f"must be {self.allowed()}", owner=owner)
        if value < self.low or (self.high is not None and value > self.high):
            raise SettingError(key, value, f"must be {self.allowed()}", owner=owner)
        return value


@dataclasses.dataclass(frozen=True)
class ChoiceSetting:
    """One of ``choices`` (text compared after strip() and lower()).

    ``unset``: spellings stored as ``None``, named in messages as ``unset_help``. ``on``: the field is
    also a switch: off (:data:`OFF`) stores ``None``, a truth value (``True``, 1, the words of
    :data:`BOOL_WORDS`) stores ``on`` or ``None``.
    """

    choices: tuple[str, ...]
    unset: Unset | None = None
    unset_help: str = ""
    on: str | None = None

    def allowed(self) -> str:
        allowed = f"must be one of {', '.join(self.choices)}"
        if self.on is not None:
            return f"{allowed}, or off ({OFF.help}), or on (True or 'true'/'on'/'yes'/'1': {self.on})"
        return f"{allowed} or {self.unset_help}" if self.unset is not None else allowed

    def __call__(self, value: Any, *, owner: str, key: str) -> str | None:
        text = _text(value)
        if self.on is not None:
            if OFF.matches(value, text):
                return None
            # True, 1 and the truth words read as every on/off field reads them; a choice is no truth word
            if isinstance(value, bool) or (type(value) is int and value in (0, 1)) or text in BOOL_WORDS:
                return self.on if parse_bool(value, key=key, owner=owner) else None
        elif self.unset is not None and self.unset.matches(value, text):
            return None
        chosen = text if text is not None else value
        if chosen not in self.choices:
            raise SettingError(key, chosen, self.allowed(), owner=owner)
        return chosen


@dataclasses.dataclass(frozen=True)
class TruthSetting:
    """A bool: ``True``/``False``, 0/1, or a truth word (:func:`parse_bool`)."""

    def __call__(self, value: Any, *, owner: str, key: str) -> bool:
        return parse_bool(value, key=key, owner=owner)


def field_reader(cls: type, name: str) -> FieldReader | None:
    """The reader field ``name`` of ``cls`` declares, or ``None`` (its text is then parsed by type)."""
    return next((f.metadata.get(READER) for f in dataclasses.fields(cls) if f.name == name), None)


_C = TypeVar("_C", bound=type)


def settings_dataclass(cls: _C) -> _C:
    """``@dataclass(frozen=True, kw_only=True)`` whose ``__init__`` reads each keyword through its field's reader.

    The dataclass's own ``__init__`` then stores values already in their final form, so nothing
    changes a field after ``__init__``; ``dataclasses.replace`` reads its changes the same way.
    """
    cls = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
    readers = {f.name: f.metadata[READER] for f in dataclasses.fields(cls) if READER in f.metadata}
    if readers:
        cls.__init__ = _reading_init(cls.__init__, readers)
    return cls


def _reading_init(init: Callable[..., None], readers: dict[str, FieldReader]) -> Callable[..., None]:
    @functools.wraps(init)
    def __init__(self: Any, **values: Any) -> None:
        owner = type(self).__name__
        init(self, **{k: readers[k](v, owner=owner, key=k) if k in readers else v for k, v in values.items()})

    return __init__
