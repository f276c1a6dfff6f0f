"""Help texts and command-line flags generated from config fields.

Help texts live in each field's ``metadata={"help": ...}``, as in Accelerate's ``utils/dataclasses.py``;
:func:`add_config_flags` turns them into ``argparse`` flags, as ``HfArgumentParser`` does, and
:func:`flags_markdown` into the tables of ``docs/train.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Literal

from ._configs import field_kinds
from ._kinds import field_reader
from ._values import parse_text


def field_help(cls: type, name: str) -> str:
    """The help text of field ``name`` of ``cls`` (its ``metadata["help"]``; ``""`` if it has none)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return str(f.metadata.get("help", ""))
    raise KeyError(
        f"{cls.__name__} has no field {name!r}; fields: {', '.join(f.name for f in dataclasses.fields(cls))}"
    )


def field_names(*classes: type) -> tuple[str, ...]:
    """The field names of ``classes``, each once, in declaration order (the first class's first)."""
    return tuple(dict.fromkeys(f.name for cls in classes for f in dataclasses.fields(cls)))


def _flag_type(cls: type, name: str, kind: Any) -> Any:
    """The argparse ``type=`` of a field: raw text for a field with a reader, else :func:`parse_text`."""
    if field_reader(cls, name) is not None:
        return str

    def parse(text: str) -> Any:
        try:
            return parse_text(text, kind, key=name, owner=cls.__name__)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parse.__name__ = getattr(kind, "__name__", str(kind))  # argparse names it in some messages
    return parse


def _metavar(kind: Any) -> str:
    """``INT``, ``FLOAT,FLOAT``, ...: what a flag of field type ``kind`` takes."""
    args = [a for a in typing.get_args(kind) if a is not type(None) and a is not Ellipsis]
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return _metavar(args[0])
    if typing.get_origin(kind) is tuple:
        return ",".join(_metavar(a) for a in args) + (",..." if Ellipsis in typing.get_args(kind) else "")
    if typing.get_origin(kind) is Literal:
        return "{" + ",".join(map(str, args)) + "}"
    return getattr(kind, "__name__", str(kind)).upper()


def _flag_rows(prefix: str, classes: tuple[type, ...]) -> list[tuple[str, type, Any, str]]:
    """``(flag, class, field type, help)`` per field of ``classes``, each field once.

    Raises:
        TypeError: two classes declare the same field with different types.
    """
    owners: dict[str, list[type]] = {}
    first: dict[str, tuple[type, Any]] = {}
    for cls in classes:
        for name, kind in field_kinds(cls).items():
            if name in first and first[name][1] != kind:
                raise TypeError(f"--{prefix}{name}: {first[name][0].__name__} and {cls.__name__} type it differently")
            first.setdefault(name, (cls, kind))
            owners.setdefault(name, []).append(cls)
    rows = []
    for name in field_names(*classes):
        cls, kind = first[name]
        only = "" if len(owners[name]) == len(classes) else f" ({', '.join(c.__name__ for c in owners[name])} only)"
        rows.append((f"--{prefix}{name}", cls, kind, field_help(cls, name) + only))
    return rows


def add_config_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, prefix: str, *classes: type
) -> tuple[str, ...]:
    """Add ``--<prefix><field>`` for every field of ``classes``, help text from the field metadata.

    Flags not given are absent from the parsed namespace (``default=argparse.SUPPRESS``), so a
    caller passes on exactly the flags given and the lower layers (environment, recipe, defaults)
    keep the rest. Values are parsed by field type; range and cross-field checks stay with the
    config class, whose messages name the field and the value. A field that several classes share
    is one flag (its type must agree); one that only some classes have says which in its help.

    Returns:
        The field names, as :func:`field_names` gives them.

    Raises:
        TypeError: two classes declare the same field with different types.
    """
    for flag, cls, kind, help_text in _flag_rows(prefix, classes):
        parser.add_argument(
            flag,
            type=_flag_type(cls, flag[2 + len(prefix) :], kind),
            metavar=_metavar(kind),
            default=argparse.SUPPRESS,
            help=help_text.replace("%", "%%"),
        )
    return field_names(*classes)


def flags_markdown(prefix: str, *classes: type) -> str:
    """The flags :func:`add_config_flags` adds, as a Markdown table (flag, value, help) for the docs."""
    lines = ["| flag | value | what it sets |", "|---|---|---|"]
    for flag, _cls, kind, help_text in _flag_rows(prefix, classes):
        lines.append(f"| `{flag}` | `{_metavar(kind)}` | {help_text.replace('|', '/')} |")
    return "\n".join(lines) + "\n"
