"""Whole configs: build a config dataclass from code, the environment, a config file or a dict.

Precedence (:func:`config_from_env`): explicit argument, then ``QACCEL_<METHOD>_<FIELD>``
environment variables, then the method's section of a config file, then the field default. Every
value is read once, where it enters: a field with a reader (:mod:`._kinds`) reads it in the
config's ``__init__``; any other field's environment text is parsed by type here. A bad value
raises a :class:`SettingProblem`, to which this module adds where that key's value came from.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from ._files import config_file_from_env, file_section
from ._kinds import field_reader
from ._values import SettingProblem, parse_text


def field_kinds(cls: type) -> dict[str, Any]:
    """``{field name: field type}`` of the dataclass ``cls``, in declaration order (annotations resolved)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _as_field_type(kind: Any, value: Any) -> Any:
    """A YAML/JSON list for a tuple field becomes a tuple (those formats have no tuples)."""
    return tuple(value) if typing.get_origin(kind) is tuple and isinstance(value, list) else value


def _build(cls: type, values: Mapping[str, Any], sources: Mapping[str, str], reader: str = "") -> Any:
    """``cls(**values)``; unknown keys (``<Class><reader>: unknown keys``) and setting errors name their source."""
    kinds = field_kinds(cls)
    unknown = sorted(set(values) - set(kinds))
    if unknown:
        where = ", ".join(sorted({sources.get(k, "?") for k in unknown}))
        raise ValueError(
            f"{cls.__name__}{reader}: unknown keys {unknown} (from {where}); known keys: {', '.join(kinds)}"
        )
    try:
        return cls(**values)
    except SettingProblem as err:
        if err.source is not None or err.key not in sources:
            raise
        raise err.with_source(sources[err.key]) from None


def config_from_dict(cls: type, data: Mapping[str, Any], *, source: str = "dict") -> Any:
    """Build ``cls`` from a mapping of field names (JSON/YAML lists become tuples for tuple fields).

    Raises:
        TypeError: ``data`` is not a mapping.
        ValueError: an unknown key (listing the known ones) or a bad value, naming ``source``.
    """
    if not isinstance(data, Mapping):
        raise TypeError(f"{cls.__name__}.from_dict: expected a mapping, got {type(data).__name__} (from {source})")
    kinds = field_kinds(cls)
    values = {k: _as_field_type(kinds[k], v) if k in kinds else v for k, v in data.items()}
    return _build(cls, values, dict.fromkeys(data, source), ".from_dict")


def _env_values(cls: type, prefix: str, environ: Mapping[str, str], unknown_env: str | None) -> dict[str, tuple[Any, str]]:
    """``{field: (value, variable)}`` of the ``<prefix><FIELD>`` variables; text parsed by type unless the field reads it."""
    kinds = field_kinds(cls)
    found: dict[str, tuple[Any, str]] = {}
    for name, text in environ.items():
        if not name.startswith(prefix):
            continue
        key = name[len(prefix) :].lower()
        if key not in kinds:
            known = ", ".join(prefix + k.upper() for k in kinds)
            raise ValueError(f"{name}: {unknown_env or f'not a {cls.__name__} field'}; known names: {known}")
        if field_reader(cls, key) is None:
            found[key] = (parse_text(text, kinds[key], key=key, owner=cls.__name__, source=name), name)
        else:
            found[key] = (text, name)
    return found


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

    A field that declares a reader (:func:`qaccel._settings.field_reader`) gets the variable's raw
    text, which its reader reads in ``cls.__init__``; any other field gets the text parsed by field
    type (:func:`parse_text`).

    Args:
        cls: the config dataclass.
        prefix: its environment prefix, e.g. ``"QACCEL_QSDP_"``.
        section: its config-file section, e.g. ``"qsdp"``.
        environ: the environment to read (default ``os.environ``).
        config_file: a config file (see :mod:`._files`) or the section as a mapping; default:
            the file named by ``QACCEL_CONFIG_FILE`` (:func:`config_file_from_env`), if any.
        explicit: field values given in code; they win over everything.
        unknown_env: what an unknown ``<prefix>*`` variable is called in the error (default
            ``"not a <Class> field"``).

    Raises:
        ValueError: an unknown variable (listing the known names), an unknown key, or a bad value,
            naming the variable or the file and key it came from.
    """
    environ = os.environ if environ is None else environ
    kinds = field_kinds(cls)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    config_file = config_file if config_file is not None else config_file_from_env(environ)
    if config_file is not None:
        section_values, section_sources = file_section(config_file, section, cls.__name__)
        values.update({k: _as_field_type(kinds[k], v) if k in kinds else v for k, v in section_values.items()})
        sources.update(section_sources)
    for key, (value, name) in _env_values(cls, prefix, environ, unknown_env).items():
        values[key], sources[key] = value, name
    values.update(explicit or {})
    sources.update(dict.fromkeys(explicit or {}, "argument"))
    return _build(cls, values, sources)


def config_to_dict(config: Any) -> dict[str, Any]:
    """A config as JSON-ready values (tuples become lists); :func:`config_from_dict` reverses it."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}


_C = TypeVar("_C", bound="SettingsMixin")


class SettingsMixin:
    """The readers every qaccel config dataclass shares: ``from_env``, ``from_file``, ``from_dict``, ``to_dict``.

    A config is ``@settings_dataclass class XConfig(SettingsMixin)`` (or a plain
    ``@dataclass(frozen=True, kw_only=True)``) with typed fields that carry ``metadata={"help": ...}``,
    optionally a reader (:mod:`qaccel._settings`'s ``IntSetting``, ``ChoiceSetting``, ...), and a
    ``__post_init__`` that validates them, raising a :class:`SettingProblem`; the readers add where a
    value came from.

    Class attributes:
        ENV_PREFIX: the environment prefix, e.g. ``"QACCEL_QSDP_"``.
        RECIPE_SECTION: the config-file section, e.g. ``"qsdp"``.
        UNKNOWN_ENV: what an unknown ``ENV_PREFIX*`` variable is called in the error.
    """

    ENV_PREFIX: ClassVar[str] = ""
    RECIPE_SECTION: ClassVar[str] = ""
    UNKNOWN_ENV: ClassVar[str | None] = None

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The field names, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

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
