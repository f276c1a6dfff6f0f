"""One reader for qaccel's settings: truth values, typed text, field readers, files, whole configs, CLI flags.

Every config dataclass (``QSDPConfig``, ``ZeroOneAdamConfig``, ``OneBitAdamConfig``) is read through
this package, so a value means the same thing and a bad one reads the same way wherever it is
written. Precedence (:func:`config_from_env`): explicit argument, then ``QACCEL_<METHOD>_<FIELD>``
environment variables, then the method's section of a config file, then the field default.

Modules, bottom up:

- :mod:`._values` and :mod:`._kinds`, the core (standard library only; no Accelerate, nothing of
  qaccel's): truth words (Accelerate's ``str_to_bool`` words, listed once), typed text, the
  structured :class:`SettingError` family (owner, key, value, allowed, source), and the field
  readers a config field declares so its value is normalised once, where it enters;
- :mod:`._files`: config files and zoo recipes (PyYAML, imported lazily);
- :mod:`._configs`: whole configs from code, environment, file or dict, and :class:`SettingsMixin`;
- :mod:`._flags`: help texts, ``argparse`` flags and the docs' flag tables.

The public names are listed once, in ``__all__`` below.
"""

from ._configs import SettingsMixin, config_from_dict, config_from_env, config_to_dict, field_kinds
from ._files import (
    CONFIG_FILE_ENV,
    CONFIG_SECTIONS,
    DEPRECATED_CONFIG_FILE_ENV,
    config_file_from_env,
    file_section,
    load_yaml,
    read_config_file,
    split_front_matter,
)
from ._flags import add_config_flags, field_help, field_names, flags_markdown
from ._kinds import (
    AUTO,
    AUTO_WORDS,
    OFF,
    OFF_WORDS,
    READER,
    ChoiceSetting,
    FieldReader,
    IntSetting,
    TruthSetting,
    Unset,
    field_reader,
    settings_dataclass,
)
from ._values import (
    BOOL_WORDS,
    FALSE_WORDS,
    NONE_WORDS,
    TRUE_WORDS,
    UNSHOWN,
    SettingError,
    SettingProblem,
    SettingTypeError,
    UnsupportedSetting,
    env_flag,
    parse_bool,
    parse_text,
)

__all__ = [
    "CONFIG_FILE_ENV",
    "DEPRECATED_CONFIG_FILE_ENV",
    "CONFIG_SECTIONS",
    "BOOL_WORDS",
    "TRUE_WORDS",
    "FALSE_WORDS",
    "NONE_WORDS",
    "OFF_WORDS",
    "AUTO_WORDS",
    "UNSHOWN",
    "SettingProblem",
    "SettingError",
    "SettingTypeError",
    "UnsupportedSetting",
    "parse_bool",
    "env_flag",
    "parse_text",
    "READER",
    "Unset",
    "OFF",
    "AUTO",
    "FieldReader",
    "IntSetting",
    "ChoiceSetting",
    "TruthSetting",
    "field_reader",
    "settings_dataclass",
    "split_front_matter",
    "load_yaml",
    "read_config_file",
    "config_file_from_env",
    "file_section",
    "config_from_dict",
    "config_from_env",
    "config_to_dict",
    "field_kinds",
    "SettingsMixin",
    "field_help",
    "field_names",
    "add_config_flags",
    "flags_markdown",
]
