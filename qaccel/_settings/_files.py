"""Config files: YAML/JSON files of method sections, zoo recipes, and the variable that names one.

A config file (:data:`CONFIG_FILE_ENV`, or a ``recipe=`` argument) is either

- a YAML or JSON mapping of sections, ``qsdp:``, ``zero_one_adam:``, ``onebit_adam:``, each a
  mapping of that config's fields; or
- a zoo recipe: a model card (``model_cards/<name>.md``, YAML front matter between ``---`` lines)
  or a recipe ``.yaml``, whose ``method:`` mapping holds those sections.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CONFIG_FILE_ENV = "QACCEL_CONFIG_FILE"
DEPRECATED_CONFIG_FILE_ENV = "QACCEL_RECIPE"
CONFIG_SECTIONS = ("qsdp", "zero_one_adam", "onebit_adam", "diloco")


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


def _load(path: Path, where: str) -> Any:
    """The file's data: front matter of a ``.md`` card, JSON, or YAML."""
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".md":
        return split_front_matter(text, where)[0]
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except ValueError as err:
            raise ValueError(f"{where}: invalid JSON: {err}") from None
    return load_yaml(text, where)


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
    data = _load(path, where)
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


def file_section(
    config_file: str | os.PathLike | Mapping[str, Any], section: str, owner: str
) -> tuple[dict[str, Any], dict[str, str]]:
    """``(values, {key: source})`` of ``section`` in a config file, or of a mapping given as the section.

    Raises:
        ValueError: the file cannot be read (:func:`read_config_file`) or its section is no mapping.
    """
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
