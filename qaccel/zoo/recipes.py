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

Each section's keys and the dataclasses live in ``qaccel.zoo.recipe_spec`` (re-exported here); this
module finds, parses and checks cards (the rules that span keys), holds the recipe defaults, and
builds ``default_recipe``, the recipe of a run without a card.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._resources import MODEL_CARDS_ENV, launch_config_names, launch_config_path, model_cards_dir
from .._settings import load_yaml, split_front_matter
from ._schema import check_section, fail
from .data_source import FILE_BUILDERS, DataSource
from .lora import parse_lora
from .recipe_spec import (
    DATASET_SCHEMA,
    DATASETS,
    LAUNCH_SCHEMA,
    METHOD_SCHEMA,
    METHODS,
    MIXED_PRECISIONS,
    MODEL_SCHEMA,
    SOURCE_DATASET,
    SOURCE_KEYS,
    SOURCE_LOCATION,
    SOURCE_SCHEMA,
    TASKS,
    TOKENIZER_KINDS,
    TOKENIZER_SCHEMA,
    TOP_SCHEMA,
    TRAINING_SCHEMA,
    DatasetSpec,
    LaunchSpec,
    MethodSpec,
    ModelSpec,
    Recipe,
    TokenizerSpec,
    TrainingSpec,
)

__all__ = [
    "TASKS",
    "DATASETS",
    "SOURCE_DATASET",
    "SOURCE_KEYS",
    "SOURCE_LOCATION",
    "METHODS",
    "MIXED_PRECISIONS",
    "CARDS_ENV",
    "DEFAULT_MLM_PROBABILITY",
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
    "DEFAULT_TRAINING",
    "DEFAULT_LAUNCH_CONFIGS",
    "DEFAULT_RECIPE_PATH",
    "default_recipe",
]

# Recipe defaults live with the recipes: BERT's masking rate, for masked-lm when training.mlm_probability is unset.
DEFAULT_MLM_PROBABILITY = 0.15
# The run without a recipe (--model_name_or_path, --task and a dataset): flags override these.
DEFAULT_TRAINING = {
    "max_steps": 100, "per_device_batch_size": 8, "gradient_accumulation_steps": 1, "learning_rate": 5e-5,
    "weight_decay": 0.0, "warmup_steps": 0, "lr_scheduler": "linear", "seed": 0, "mixed_precision": "no",
}  # fmt: skip
# method -> the shipped launch config (2 CPU processes; `qaccel train --launch_config` picks another)
DEFAULT_LAUNCH_CONFIGS = {"qsdp": "cpu_2proc_qsdp", "none": "cpu_2proc_qsdp", "zero_one_adam": "cpu_2proc_ddp", "onebit_adam": "cpu_2proc_ddp", "diloco": "cpu_2proc_ddp"}
# The path of a run without a recipe: no card behind it, and its checkpoints record no recipe name.
DEFAULT_RECIPE_PATH = Path("<defaults>")
CARDS_ENV = MODEL_CARDS_ENV
_NAME = re.compile(r"^[a-z0-9][a-z0-9.\-]*$")


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


def recipe_from_dict(data: Any, *, card_body: str = "", path: Path | str = "<dict>") -> Recipe:
    """Validate front-matter data and build the ``Recipe``.

    Raises:
        ValueError: naming the recipe, the dotted key, the value and what is allowed.
    """
    path = Path(path)
    name_hint = data.get("name") if isinstance(data, dict) else None
    where = f"recipe {name_hint or path.stem!r} ({path})"
    top = check_section(where, "", data, TOP_SCHEMA)
    if not _NAME.match(top["name"]):
        fail(where, "name", top["name"], "lower-case letters, digits, '.' and '-', starting with a letter or digit")
    model = ModelSpec(**check_section(where, "model", top["model"], MODEL_SCHEMA))
    tokenizer = TokenizerSpec(**check_section(where, "tokenizer", top["tokenizer"], TOKENIZER_SCHEMA))
    dataset = _dataset(where, top["dataset"], top["task"])
    training = _training(where, top["training"], top["task"])
    method_values = check_section(where, "method", top["method"], METHOD_SCHEMA)
    for section in ("zero_one_adam", "onebit_adam"):  # YAML lists -> tuples, as the config fields are typed
        method_values[section] = {k: tuple(v) if isinstance(v, list) else v for k, v in method_values[section].items()}
    method = MethodSpec(**method_values)
    launch = LaunchSpec(**check_section(where, "launch", top["launch"], LAUNCH_SCHEMA))
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

    values = check_section(where, "training", section, TRAINING_SCHEMA)
    schedulers = tuple(s.value for s in SchedulerType)
    if values["lr_scheduler"] not in schedulers:
        fail(where, "training.lr_scheduler", values["lr_scheduler"], "one of " + ", ".join(schedulers))
    if values["warmup_steps"] > values["max_steps"]:
        fail(where, "training.warmup_steps", values["warmup_steps"], f"<= training.max_steps ({values['max_steps']})")
    for key in ("eval_steps", "save_steps"):
        if values[key] is None:
            values[key] = values["max_steps"]
    if task == "masked-lm" and values["mlm_probability"] is None:
        values["mlm_probability"] = DEFAULT_MLM_PROBABILITY
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
    values = check_section(where, "dataset", section, SOURCE_SCHEMA if is_source else DATASET_SCHEMA)
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
    from ..optim import DiLoCoConfig, OneBitAdamConfig, ZeroOneAdamConfig

    sections = (("qsdp", QSDPConfig), ("zero_one_adam", ZeroOneAdamConfig), ("onebit_adam", OneBitAdamConfig), ("diloco", DiLoCoConfig))
    for section, cls in sections:
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


# -- the run without a recipe ---------------------------------------------------------------


def default_recipe(model_name_or_path: str, task: str, *, method: str = "qsdp", max_seq_length: int = 128) -> Recipe:
    """The recipe of a run without one: the pretrained model, ``DEFAULT_TRAINING``, ``method``.

    The FSDP2 wrap unit is the model's repeated block (``detect_layer_cls``), the tokenizer the
    model's own, the method settings their config defaults, the launch config
    ``DEFAULT_LAUNCH_CONFIGS[method]``; evaluation and a checkpoint at the end. Its name is
    ``custom`` and its dataset ``user`` (the data comes from a ``DataSource``).
    """
    from .models import detect_layer_cls

    training = TrainingSpec(
        **DEFAULT_TRAINING,
        eval_steps=DEFAULT_TRAINING["max_steps"],
        save_steps=DEFAULT_TRAINING["max_steps"],
        mlm_probability=DEFAULT_MLM_PROBABILITY if task == "masked-lm" else None,
    )
    launch = launch_config_path(DEFAULT_LAUNCH_CONFIGS[method])
    return Recipe(
        name="custom",
        summary=f"{model_name_or_path} for {task} on a user's dataset",
        task=task,
        model=ModelSpec(name_or_path=model_name_or_path, config=None, transformer_layer_cls=detect_layer_cls(model_name_or_path, task)),
        tokenizer=TokenizerSpec(name_or_path=None, kind=None, vocab_size=None),
        dataset=DatasetSpec(name="user", seq_len=max_seq_length, eval_fraction=0.0),
        training=training,
        method=MethodSpec(name=method, qsdp={}, zero_one_adam={}, onebit_adam={}),
        launch=LaunchSpec(config=f"launch_configs/{launch.name}", num_processes=2),
        expected={},
        card_body="",
        path=DEFAULT_RECIPE_PATH,
    )
