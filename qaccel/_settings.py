"""One reader for qaccel's settings: truth values, typed text, environment, files, help, CLI flags.

Every config dataclass (``QSDPConfig``, ``ZeroOneAdamConfig``, ``OneBitAdamConfig``) is read through
the functions here, so a value means the same thing and a bad one reads the same way wherever it is
written. Precedence (:func:`config_from_env`): explicit argument, then ``QACCEL_<METHOD>_<FIELD>``
environment variables, then the method's section of a config file, then the field default.

A config file (:data:`CONFIG_FILE_ENV`, or a ``recipe=`` argument) is either

- a YAML or JSON mapping of sections, ``qsdp:``, ``zero_one_adam:``, ``onebit_adam:``, each a
  mapping of that config's fields; or
- a zoo recipe: a model card (``model_cards/<name>.md``, YAML front matter between ``---`` lines)
  or a recipe ``.yaml``, whose ``method:`` mapping holds those sections.

Truth values go through Accelerate's ``str_to_bool`` (the parser behind ``accelerate launch``'s own
environment flags), wrapped so that a bad value names the key, the value and the words allowed. Help
texts live in each field's ``metadata={"help": ...}``, as in Accelerate's ``utils/dataclasses.py``;
:func:`add_config_flags` turns them into ``argparse`` flags, as ``HfArgumentParser`` does.

This module sits below every other qaccel module: it imports only the standard library, PyYAML and
(lazily, when a truth value is parsed) ``accelerate.utils``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import types
import typing
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

__all__ = [
    "CONFIG_FILE_ENV",
    "DEPRECATED_CONFIG_FILE_ENV",
    "CONFIG_SECTIONS",
    "BOOL_WORDS",
    "parse_bool",
    "env_flag",
    "parse_text",
    "split_front_matter",
    "load_yaml",
    "read_config_file",
    "config_file_from_env",
    "config_from_dict",
    "config_from_env",
    "config_to_dict",
    "SettingsMixin",
    "field_help",
    "field_names",
    "add_config_flags",
    "flags_markdown",
]

CONFIG_FILE_ENV = "QACCEL_CONFIG_FILE"
DEPRECATED_CONFIG_FILE_ENV = "QACCEL_RECIPE"
CONFIG_SECTIONS = ("qsdp", "zero_one_adam", "onebit_adam")
# What accelerate.utils.str_to_bool accepts (accelerate/utils/environment.py), for messages; the
# short y/t/n/f are listed last since nobody should write them on purpose.
BOOL_WORDS = ("1", "true", "on", "yes", "0", "false", "off", "no", "y", "t", "n", "f")
_BOOL_ALLOWED = f"True/False or one of {', '.join(BOOL_WORDS[:8])} (any case; also {', '.join(BOOL_WORDS[8:])})"
_NONE_WORDS = ("none", "null")


def _from(source: str | None) -> str:
    return f" (from {source})" if source else ""


# -- single values -----------------------------------------------------------------------------


def parse_bool(value: Any, *, key: str, source: str | None = None) -> bool:
    """A truth value: ``True``/``False``, the ints 0/1, or a word ``str_to_bool`` accepts.

    Args:
        value: the value as given (code, file or environment).
        key: what it sets, for the message (``"QSDPConfig.prefetch"``, ``"HF_HUB_OFFLINE"``).
        source: where it came from (an environment variable, a file and key), if not code.

    Returns:
        The bool.

    Raises:
        ValueError: anything else, naming the key, the value, the allowed words and the source.

    Example::

        parse_bool(" Yes ", key="QSDPConfig.prefetch")  # True
    """
    if isinstance(value, bool):
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        from accelerate.utils import str_to_bool

        try:
            return bool(str_to_bool(value.strip(), to_bool=True))
        except ValueError:
            pass
    raise ValueError(f"{key}={value!r}{_from(source)}: not a boolean; must be {_BOOL_ALLOWED}")


def env_flag(name: str, environ: Mapping[str, str] | None = None, *, default: bool = False) -> bool:
    """The truth value of the environment variable ``name``; unset or blank gives ``default``.

    Raises:
        ValueError: a value that is no truth value (as Accelerate's ``parse_flag_from_env`` does).
    """
    value = (os.environ if environ is None else environ).get(name, "")
    return parse_bool(value, key=name) if value.strip() else default


def parse_text(text: str, kind: Any, *, key: str, source: str | None = None) -> Any:
    """Turn ``text`` (an environment variable, a flag) into a value of the field type ``kind``.

    Handles ``bool``, ``int``, ``float``, ``str``, ``Literal[...]``, ``X | None`` (``none``/``null``
    give ``None``) and ``tuple[X, ...]`` / ``tuple[X, Y]`` (comma-separated, brackets optional).

    Raises:
        ValueError: text that is no value of ``kind``, naming the key, the text and the source.
        TypeError: a field type this reader does not handle (a bug in the config class).
    """
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    stripped = text.strip()
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        if len(members) != 1:
            raise TypeError(f"{key}: cannot read text into {kind} (only X | None unions are supported)")
        if type(None) in args and stripped.lower() in _NONE_WORDS:
            return None
        return parse_text(text, members[0], key=key, source=source)
    if kind is bool:
        return parse_bool(text, key=key, source=source)
    if kind in (int, float):
        try:
            return kind(stripped)
        except ValueError:
            name = "an int" if kind is int else "a number"
            raise ValueError(f"{key}={text!r}{_from(source)}: not {name}") from None
    if kind is str:
        return stripped
    if origin is Literal:
        for choice in args:
            if stripped == str(choice):
                return choice
        raise ValueError(f"{key}={text!r}{_from(source)}: must be one of {', '.join(map(str, args))}")
    if origin is tuple:
        parts = [p.strip() for p in re.sub(r"[()\[\]]", "", stripped).split(",") if p.strip()]
        kinds = [args[0]] * len(parts) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(parts) != len(kinds):
            names = ", ".join(k.__name__ for k in kinds)
            raise ValueError(f"{key}={text!r}{_from(source)}: must be {len(kinds)} comma-separated values ({names})")
        return tuple(parse_text(p, k, key=key, source=source) for p, k in zip(parts, kinds, strict=True))
    raise TypeError(f"{key}: cannot read text into {kind}")


# -- files ---------------------------------------------------------------------------------------


def load_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load`` whose syntax errors name ``where`` (a file, a recipe)."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"{where}: invalid YAML: {err}") from None


def split_front_matter(text: str, where: str) -> tuple[Any, str]:
    """Split a model card into its YAML front matter (parsed) and the Markdown body after it.

    Raises:
        ValueError: no opening or closing ``---`` line, or invalid YAML, naming ``where``.
    """
    lines = text.splitlines(keepends=True)
    if not lines or lines[0].strip() != "---":
        raise ValueError(f"{where}: a recipe card must start with a '---' line, then YAML front matter, then '---'")
    for i in range(1, len(lines)):
        if lines[i].strip() == "---":
            return load_yaml("".join(lines[1:i]), where), "".join(lines[i + 1 :]).lstrip("\n")
    raise ValueError(f"{where}: the front matter has no closing '---' line")


def read_config_file(path: str | os.PathLike) -> tuple[dict[str, Any], str]:
    """The method sections of a config file, and the key path they sit under.

    Returns:
        ``(sections, key_prefix)``: ``sections`` maps section names (:data:`CONFIG_SECTIONS`) to their
        mappings; ``key_prefix`` is ``"method."`` for a zoo recipe (a model card ``.md`` or a recipe
        with a ``method:`` mapping), else ``""``.

    Raises:
        ValueError: a missing file, invalid YAML/JSON, or a layout other than the two above, naming
            the file and the key.
    """
    path = Path(path)
    where = f"recipe {str(path)!r}"
    if not path.is_file():
        raise ValueError(
            f"{where}: no such file ({CONFIG_FILE_ENV} and recipe= name a file: a YAML/JSON file with "
            f"{'/'.join(CONFIG_SECTIONS)} sections, or a recipe such as model_cards/gpt2-tiny.md)"
        )
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".md":
        data, _ = split_front_matter(text, where)
    elif path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except ValueError as err:
            raise ValueError(f"{where}: invalid JSON: {err}") from None
    else:
        data = load_yaml(text, where)
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise ValueError(
            f"{where}: must be a mapping of sections ({', '.join(CONFIG_SECTIONS)}), got {type(data).__name__}"
        )
    if "method" in data or path.suffix.lower() == ".md":
        method = data.get("method")
        if not isinstance(method, Mapping):
            raise ValueError(
                f"{where}: a recipe keeps its method settings in a 'method:' mapping, got method={method!r}"
            )
        return {k: v for k, v in method.items() if k in CONFIG_SECTIONS}, "method."
    unknown = sorted(set(data) - set(CONFIG_SECTIONS))
    if unknown:
        raise ValueError(f"{where}: unknown sections {unknown}; known sections: {', '.join(CONFIG_SECTIONS)}")
    return dict(data), ""


@functools.cache
def _warn_deprecated_config_file_env() -> None:
    warnings.warn(
        f"{DEPRECATED_CONFIG_FILE_ENV} is deprecated: name the file in {CONFIG_FILE_ENV} instead (the same "
        f"YAML/JSON file, or a recipe such as model_cards/gpt2-tiny.md); {CONFIG_FILE_ENV} wins when both are set",
        FutureWarning,
        stacklevel=5,
    )


def config_file_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The config file named by ``QACCEL_CONFIG_FILE`` (or, with a one-time warning, ``QACCEL_RECIPE``)."""
    environ = os.environ if environ is None else environ
    path = environ.get(CONFIG_FILE_ENV, "").strip()
    deprecated = environ.get(DEPRECATED_CONFIG_FILE_ENV, "").strip()
    if deprecated:
        _warn_deprecated_config_file_env()
    return path or deprecated or None


def _file_section(
    config_file: str | os.PathLike | Mapping[str, Any], section: str, owner: str
) -> tuple[dict[str, Any], dict[str, str]]:
    """``(values, {key: source})`` of ``section`` in a config file, or of a mapping given as the section."""
    if isinstance(config_file, Mapping):
        return dict(config_file), dict.fromkeys(config_file, f"recipe {section} mapping")
    sections, prefix = read_config_file(config_file)
    values = sections.get(section) or {}
    if not isinstance(values, Mapping):
        raise ValueError(
            f"{owner} recipe {str(config_file)!r}: the {prefix + section!r} section must be a mapping of {owner} "
            f"fields, got {type(values).__name__}"
        )
    return dict(values), {key: f"recipe {config_file}, key {prefix}{section}.{key}" for key in values}


# -- whole configs -------------------------------------------------------------------------------


def _kinds(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _as_field_type(kind: Any, value: Any) -> Any:
    """A YAML/JSON list for a tuple field becomes a tuple (those formats have no tuples)."""
    return tuple(value) if typing.get_origin(kind) is tuple and isinstance(value, list) else value


def _build(cls: type, values: Mapping[str, Any], sources: Mapping[str, str], reader: str = "") -> Any:
    """``cls(**values)``; unknown keys (``<Class><reader>: unknown keys``) and field errors name their source."""
    kinds = _kinds(cls)
    unknown = sorted(set(values) - set(kinds))
    if unknown:
        where = ", ".join(sorted({sources.get(k, "?") for k in unknown}))
        raise ValueError(
            f"{cls.__name__}{reader}: unknown keys {unknown} (from {where}); known keys: {', '.join(kinds)}"
        )
    try:
        return cls(**values)
    except (ValueError, TypeError, NotImplementedError) as err:
        # Field checks raise "<Class>.<field>=<value>: ..."; add the source of that field's value.
        match = re.match(rf"{re.escape(cls.__name__)}\.(\w+)", str(err))
        if match is None or match.group(1) not in sources or "(from " in str(err):
            raise
        raise type(err)(f"{err} (from {sources[match.group(1)]})") from None


def config_from_dict(cls: type, data: Mapping[str, Any], *, source: str = "dict") -> Any:
    """Build ``cls`` from a mapping of field names (JSON/YAML lists become tuples for tuple fields).

    Raises:
        TypeError: ``data`` is not a mapping.
        ValueError: an unknown key (listing the known ones) or a bad value, naming ``source``.
    """
    if not isinstance(data, Mapping):
        raise TypeError(f"{cls.__name__}.from_dict: expected a mapping, got {type(data).__name__} (from {source})")
    kinds = _kinds(cls)
    values = {k: _as_field_type(kinds[k], v) if k in kinds else v for k, v in data.items()}
    return _build(cls, values, dict.fromkeys(data, source), ".from_dict")


def config_from_env(
    cls: type,
    *,
    prefix: str,
    section: str,
    environ: Mapping[str, str] | None = None,
    config_file: str | os.PathLike | Mapping[str, Any] | None = None,
    explicit: Mapping[str, Any] | None = None,
    unknown_env: str | None = None,
) -> Any:
    """Build ``cls``: ``explicit`` values, then ``<prefix><FIELD>`` variables, then the file, then defaults.

    A class whose ``__post_init__`` reads the text spellings of every field itself sets the class
    attribute ``PARSES_TEXT = True`` and gets the variables' raw text; any other class gets the text
    parsed by field type (:func:`parse_text`).

    Args:
        cls: the config dataclass.
        prefix: its environment prefix, e.g. ``"QACCEL_QSDP_"``.
        section: its config-file section, e.g. ``"qsdp"``.
        environ: the environment to read (default ``os.environ``).
        config_file: a config file (see the module docstring) or the section as a mapping; default:
            the file named by ``QACCEL_CONFIG_FILE`` (:func:`config_file_from_env`), if any.
        explicit: field values given in code; they win over everything.
        unknown_env: what an unknown ``<prefix>*`` variable is called in the error (default
            ``"not a <Class> field"``).

    Raises:
        ValueError: an unknown variable (listing the known names), an unknown key, or a bad value,
            naming the variable or the file and key it came from.
    """
    environ = os.environ if environ is None else environ
    kinds = _kinds(cls)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    config_file = config_file if config_file is not None else config_file_from_env(environ)
    if config_file is not None:
        section_values, section_sources = _file_section(config_file, section, cls.__name__)
        values.update({k: _as_field_type(kinds[k], v) if k in kinds else v for k, v in section_values.items()})
        sources.update(section_sources)
    for name, text in environ.items():
        if not name.startswith(prefix):
            continue
        key = name[len(prefix) :].lower()
        if key not in kinds:
            known = ", ".join(prefix + k.upper() for k in kinds)
            raise ValueError(f"{name}: {unknown_env or f'not a {cls.__name__} field'}; known names: {known}")
        parses_text = getattr(cls, "PARSES_TEXT", False)
        values[key] = text if parses_text else parse_text(text, kinds[key], key=f"{cls.__name__}.{key}", source=name)
        sources[key] = name
    values.update(explicit or {})
    sources.update(dict.fromkeys(explicit or {}, "argument"))
    return _build(cls, values, sources)


def config_to_dict(config: Any) -> dict[str, Any]:
    """A config as JSON-ready values (tuples become lists); :func:`config_from_dict` reverses it."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}


_C = TypeVar("_C", bound="SettingsMixin")


class SettingsMixin:
    """The readers every qaccel config dataclass shares: ``from_env``, ``from_file``, ``from_dict``, ``to_dict``.

    A config is ``@dataclass(frozen=True, kw_only=True) class XConfig(SettingsMixin)`` with typed
    fields that carry ``metadata={"help": ...}`` and a ``__post_init__`` that validates them, raising
    ``"XConfig.<field>=<value>: <what is allowed>"``; the readers add where a value came from.

    Class attributes:
        ENV_PREFIX: the environment prefix, e.g. ``"QACCEL_QSDP_"``.
        RECIPE_SECTION: the config-file section, e.g. ``"qsdp"``.
        PARSES_TEXT: ``__post_init__`` reads the text spellings of every field itself, so environment
            and flag text reach it unparsed (else :func:`parse_text` parses it by field type).
        UNKNOWN_ENV: what an unknown ``ENV_PREFIX*`` variable is called in the error.
    """

    ENV_PREFIX: ClassVar[str] = ""
    RECIPE_SECTION: ClassVar[str] = ""
    PARSES_TEXT: ClassVar[bool] = False
    UNKNOWN_ENV: ClassVar[str | None] = None

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The field names, in declaration order."""
        return field_names(cls)

    @classmethod
    def from_dict(cls: type[_C], data: Mapping[str, Any], *, source: str = "dict") -> _C:
        """Build from a mapping of field names (:func:`config_from_dict`); ``source`` names it in errors.

        Raises:
            TypeError: ``data`` is not a mapping.
            ValueError: an unknown key (listing the known ones) or an invalid value.
        """
        return config_from_dict(cls, data, source=source)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict that :meth:`from_dict` turns back into an equal config."""
        return config_to_dict(self)

    @classmethod
    def from_file(cls: type[_C], path: str | os.PathLike, **overrides: Any) -> _C:
        """The ``RECIPE_SECTION`` of a config file (or a recipe's ``method.<section>``); ``overrides`` win.

        The environment is not read. Raises as :meth:`from_env`.
        """
        return config_from_env(
            cls, prefix=cls.ENV_PREFIX, section=cls.RECIPE_SECTION, environ={}, config_file=path, explicit=overrides
        )

    @classmethod
    def from_env(
        cls: type[_C],
        environ: Mapping[str, str] | None = None,
        *,
        recipe: str | os.PathLike | Mapping[str, Any] | None = None,
        **overrides: Any,
    ) -> _C:
        """Explicit ``overrides``, then ``<ENV_PREFIX><FIELD>`` variables, then a config file, then defaults.

        Args:
            environ: the environment to read (default ``os.environ``).
            recipe: a config file: YAML/JSON whose ``RECIPE_SECTION`` section holds settings, or a zoo
                recipe (``model_cards/<name>.md``; its ``method.<RECIPE_SECTION>``), or that section as a
                mapping; default: the file named by ``QACCEL_CONFIG_FILE`` (or the deprecated
                ``QACCEL_RECIPE``), if set. A file without the section contributes nothing.
            **overrides: field values given in code.

        Raises:
            ValueError: a variable under the prefix or a file key that names no field, or a value that
                does not parse or validate (the message names the variable, or the file and key).
        """
        return config_from_env(
            cls,
            prefix=cls.ENV_PREFIX,
            section=cls.RECIPE_SECTION,
            environ=environ,
            config_file=recipe,
            explicit=overrides,
            unknown_env=cls.UNKNOWN_ENV,
        )


# -- help and flags -------------------------------------------------------------------------------


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
    """The argparse ``type=`` of a field: raw text for a ``PARSES_TEXT`` class, else :func:`parse_text`."""
    if getattr(cls, "PARSES_TEXT", False):
        return str

    def parse(text: str) -> Any:
        try:
            return parse_text(text, kind, key=f"{cls.__name__}.{name}")
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
        for name, kind in _kinds(cls).items():
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
