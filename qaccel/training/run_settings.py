"""What a training run is asked to do: its typed settings (:class:`TrainingSettings`) and the checked inputs (:class:`RunInputs`).

The settings are the recipe's ``training:`` section with the flags given on the command line on
top, built once before any process group exists. A checkpoint records them under
``extra["training"]`` (:meth:`TrainingSettings.to_dict`), and tensorboard's hyperparameters are the
same dict.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..checkpoint import build_run_state
from .methods import MethodPlan

if TYPE_CHECKING:
    from ..zoo import Recipe
    from ..zoo.lora import LoraSpec
    from ..zoo.user_data import DataSource

__all__ = ["TRAINING_FLAGS", "RunInputs", "TrainingSettings"]

# A field's type -> the values it takes and how a message says so. bool is an int to Python but never a
# count or a rate here; an int is a valid float (PEP 484's numeric tower), kept as given.
_ACCEPTED: dict[type, tuple[tuple[type, ...], str]] = {int: ((int,), "an int"), float: ((int, float), "a number"), str: ((str,), "a string")}


@dataclass(frozen=True, kw_only=True)
class TrainingSettings:
    """The training settings of a run: the recipe's ``training:`` values, each overridden by its flag.

    Every field is a flag of ``qaccel.train`` (``--<field>``) and a key of a recipe's ``training:``
    section; the recipe schema checks the recipe's values and argparse the flags' types, so this
    check guards library callers. Values are kept as given (a recipe's ``weight_decay: 0`` stays
    ``0``): the checkpoint records exactly them.

    Attributes:
        max_steps: optimizer steps of the run.
        per_device_batch_size: sequences per micro-batch on each process.
        gradient_accumulation_steps: micro-batches per optimizer step.
        learning_rate: the peak learning rate (after warm-up).
        weight_decay: AdamW weight decay (biases and norms excluded).
        warmup_steps: optimizer steps of linear warm-up.
        lr_scheduler: a transformers scheduler name (linear, cosine, constant, ...).
        seed: data order, dropout and masked-LM masks.
        save_steps: checkpoint every N optimizer steps (0: only at the end).
        eval_steps: evaluate every N optimizer steps (0: only at the end).
        mixed_precision: ``no``, ``bf16`` or ``fp16``.

    Raises:
        TypeError: a value of the wrong type, naming the field.
        ValueError: a value out of range (no steps, an empty batch, a negative rate), naming the field.
    """

    max_steps: int
    per_device_batch_size: int
    gradient_accumulation_steps: int
    learning_rate: float
    weight_decay: float
    warmup_steps: int
    lr_scheduler: str
    seed: int
    save_steps: int
    eval_steps: int
    mixed_precision: str

    def __post_init__(self) -> None:
        for name, field_type in _field_types().items():
            value = getattr(self, name)
            accepted, allowed = _ACCEPTED[field_type]
            if isinstance(value, bool) or not isinstance(value, accepted):
                raise TypeError(f"TrainingSettings.{name}={value!r}: must be {allowed} (from --{name} or the recipe's training.{name})")
            if name in _MINIMUM and value < _MINIMUM[name]:  # 0 steps or a negative batch would run nothing, or crash later
                raise ValueError(f"--{name}={value!r}: must be >= {_MINIMUM[name]} (from --{name} or the recipe's training.{name})")

    @classmethod
    def from_recipe(cls, training: Any, flags: Mapping[str, Any]) -> TrainingSettings:
        """The recipe's values (``training``: a ``TrainingSpec``), with each flag in ``flags`` that is not None on top."""
        values = {name: getattr(training, name) for name in TRAINING_FLAGS}
        values.update({name: flags[name] for name in TRAINING_FLAGS if flags.get(name) is not None})
        return cls(**values)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrainingSettings:
        """The inverse of :meth:`to_dict` (e.g. a checkpoint's ``extra["training"]``).

        Raises:
            ValueError: an unknown or missing key, listing the known ones.
        """
        unknown, missing = sorted(set(values) - set(TRAINING_FLAGS)), [n for n in TRAINING_FLAGS if n not in values]
        if unknown or missing:
            raise ValueError(f"TrainingSettings.from_dict: unknown keys {unknown}, missing keys {missing}; the keys are {', '.join(TRAINING_FLAGS)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON values, in field order: what a checkpoint records and the trackers show."""
        return dataclasses.asdict(self)


# The smallest value each numeric setting may take (save_steps and eval_steps: 0 means only at the end).
_MINIMUM = {
    "max_steps": 1, "per_device_batch_size": 1, "gradient_accumulation_steps": 1, "learning_rate": 0, "weight_decay": 0,
    "warmup_steps": 0, "save_steps": 0, "eval_steps": 0,
}  # fmt: skip


@functools.cache
def _field_types() -> dict[str, type]:
    hints = typing.get_type_hints(TrainingSettings)  # the annotations are strings (postponed evaluation)
    return {f.name: hints[f.name] for f in dataclasses.fields(TrainingSettings)}


TRAINING_FLAGS = tuple(f.name for f in dataclasses.fields(TrainingSettings))
"""The training flags of ``qaccel.train`` (each also a recipe ``training:`` key), in the order a checkpoint records them."""


@dataclass(frozen=True)
class RunInputs:
    """Everything the run is asked to do, checked before any process group, file or model exists."""

    recipe: Recipe  # with --task, --max_seq_length applied; without --recipe: default_recipe(...)
    data_source: DataSource | None  # the user's dataset, or None: the recipe's
    settings: TrainingSettings  # recipe values, flags on top
    plan: MethodPlan
    model_source: str | None  # pretrained weights and tokenizer (flag, else recipe), or None: from config
    output_dir: Path
    resume_from: Path | None
    saved: dict | None  # the resumed checkpoint's run state
    resume_warnings: list[str]
    replica_interval: int  # QACCEL_CHECK_REPLICAS
    world_size: int
    lora: LoraSpec | None = None  # the recipe's lora: section with --lora_* on top; None: every weight trains

    @property
    def is_streaming(self) -> bool:
        """The train split is streamed (``--streaming``): read on the fly, resumed from its stream state."""
        return self.data_source is not None and self.data_source.streaming

    def run_state(self, step: int, wire_total: int, metrics: dict | None) -> dict:
        """The metadata a checkpoint of this run records (and a resume compares)."""
        from ..zoo.user_data import DEFAULT_RECIPE_PATH  # the zoo loads datasets and tokenizers: on first use

        return build_run_state(
            method=self.plan.method,
            method_config=self.plan.config_dict(),
            recipe=None if self.recipe.path == DEFAULT_RECIPE_PATH else self.recipe.name,
            task=self.recipe.task,
            step=step,
            world_size=self.world_size,
            wire_bytes_total=wire_total,
            metrics=metrics,
            base_model=self.model_source,
            dataset=self.recipe.dataset.name if self.data_source is None else self.data_source.hub_id,
            extra={
                "training": self.settings.to_dict(),
                "parallelism": self.plan.parallelism,
                **({"lora": self.lora.to_dict()} if self.lora is not None else {}),
                **({"data": self.data_source.to_dict()} if self.data_source is not None else {}),
            },
        )
