"""Read a DeepSpeed config JSON for the 1-bit optimizers: every key mapped, reported as ignored, or refused.

DeepSpeed 0.19 dropped ``ZeroOneAdam`` and ``OneBitAdam`` (deepspeedai/DeepSpeed#8490); their users bring
configs such as the tutorials'::

    {"train_batch_size": 4096, "train_micro_batch_size_per_gpu": 16,
     "optimizer": {"type": "ZeroOneAdam", "params": {"lr": 1e-3, "var_freeze_step": 1000, ...}},
     "gradient_clipping": 1.0, "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 16}}

:func:`read_deepspeed_config` reads one (a path or a dict) into a :class:`DeepSpeedConfig`: the optimizer's
settings (``optimizer.params`` with the engine key ``gradient_clipping``, and a scheduler's peak learning
rate; :meth:`DeepSpeedConfig.optimizer_config` builds the config) and the engine settings in neutral terms
(batch sizes, precision, schedule), which ``qaccel train --deepspeed_config`` turns into its flags
(:mod:`qaccel.training.deepspeed_config`). ``ZeroOneAdamConfig.from_deepspeed`` /
``OneBitAdamConfig.from_deepspeed`` call :func:`optimizer_config_from_deepspeed`. A key that does not
change training (logging, monitors, profilers) is accepted and listed in ``ignored``; a key whose value is
what happens here anyway (``prescale_gradients: false``, ZeRO stage 0) is accepted; anything else raises,
naming the key and what is allowed, before any process group exists. ``docs/from_deepspeed.md`` has the
table.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from .._settings import SettingProblem
from ._deepspeed_engine import (
    IGNORED_KEYS,
    DeepSpeedSchedule,
    accepted_keys,
    config_block,
    load_deepspeed,
    positive_int,
    read_precision,
    read_schedule,
)

if TYPE_CHECKING:
    from .config import OneBitConfigBase

__all__ = [
    "DEEPSPEED_OPTIMIZERS",
    "IGNORED_KEYS",
    "DeepSpeedConfig",
    "DeepSpeedSchedule",
    "read_deepspeed_config",
    "optimizer_config_from_deepspeed",
]

# DeepSpeed lower-cases an optimizer's type before it looks it up (deepspeed/runtime/config.py), so
# "OnebitAdam" (the 1-bit tutorial's table) names 1-bit Adam too. Lower-cased type -> qaccel method
# (also the config's RECIPE_SECTION), and the spelling DeepSpeed's docs use.
DEEPSPEED_OPTIMIZERS = {"zerooneadam": "zero_one_adam", "onebitadam": "onebit_adam"}
_TYPE_SPELLING = {"zero_one_adam": "ZeroOneAdam", "onebit_adam": "OneBitAdam"}
_TYPE_NAMES = ", ".join(_TYPE_SPELLING.values())
_C = TypeVar("_C", bound="OneBitConfigBase")


@dataclass(frozen=True)
class DeepSpeedConfig:
    """A DeepSpeed config as qaccel runs it (built by :func:`read_deepspeed_config`).

    Attributes:
        source: where it came from (the file, or ``"dict"``), for messages.
        optimizer_type: the ``optimizer.type`` as written.
        method: ``zero_one_adam`` or ``onebit_adam``.
        params: ``optimizer.params`` as written.
        engine_settings: optimizer fields the engine's keys set: ``gradient_clipping``, and ``lr`` from a
            scheduler's ``warmup_max_lr`` (DeepSpeed's scheduler writes each group's lr).
        train_batch_size, micro_batch_size, gradient_accumulation_steps: the batch keys as written (None: absent).
        mixed_precision: ``fp16``, ``bf16`` or ``no`` from the ``fp16`` / ``bf16`` blocks; None: neither block.
        schedule: the scheduler, or None.
        ignored: keys accepted without effect (dotted: ``zero_optimization.reduce_bucket_size``).
        notes: how a key was read where it differs from a plain copy (a scheduler's lr replacing the optimizer's).
    """

    source: str
    optimizer_type: str
    method: str
    params: dict[str, Any]
    engine_settings: dict[str, Any]
    train_batch_size: int | None
    micro_batch_size: int | None
    gradient_accumulation_steps: int | None
    mixed_precision: str | None
    schedule: DeepSpeedSchedule | None
    ignored: tuple[str, ...]
    notes: tuple[str, ...]

    @property
    def optimizer_keys(self) -> tuple[str, ...]:
        """The optimizer config fields the JSON sets (what a command-line flag may not contradict)."""
        return tuple(dict.fromkeys([*self.params, *self.engine_settings]))

    def optimizer_config(self, cls: type[_C]) -> _C:
        """The optimizer's config: :attr:`params`, then :attr:`engine_settings`, over ``cls``'s defaults (DeepSpeed's).

        Raises:
            ValueError: ``cls`` is not the config of :attr:`optimizer_type`, or a setting is invalid (naming it).
        """
        if cls.RECIPE_SECTION != self.method:  # the section is named after the method: zero_one_adam, onebit_adam
            raise ValueError(
                f"DeepSpeed config {self.source}: optimizer.type={self.optimizer_type!r} is not {cls.__name__}'s; "
                f"allowed: {_TYPE_SPELLING[cls.RECIPE_SECTION]} (any case)"
            )
        config = cls.from_dict(self.params, source=f"{self.source} optimizer.params")
        try:
            return dataclasses.replace(config, **self.engine_settings)
        except SettingProblem as err:  # gradient_clipping, or warmup_max_lr as lr
            raise err.with_source(f"{self.source} engine keys") from None

    def batch(self, world_size: int) -> tuple[int | None, int | None]:
        """``(micro batch per process, gradient accumulation steps)`` for ``world_size`` processes, as DeepSpeed
        derives and checks them: ``train_batch_size == micro * accumulation * world_size``, accumulation 1 when
        only the micro-batch is given. None for what no key decides (the run's own setting applies).

        Raises:
            ValueError: the keys disagree with each other or with the world size, naming them.
        """
        total, micro, steps = self.train_batch_size, self.micro_batch_size, self.gradient_accumulation_steps
        if total is None:  # nothing to check; DeepSpeed accumulates 1 micro-batch unless told otherwise
            return micro, (steps or 1) if micro is not None else steps
        if micro is None and steps is None:
            micro, steps = total // world_size, 1
        elif micro is None:
            micro = total // world_size // steps
        elif steps is None:
            steps = total // micro // world_size
        if micro < 1 or steps < 1 or total != micro * steps * world_size:
            raise ValueError(
                f"DeepSpeed config {self.source}: train_batch_size={total} must equal train_micro_batch_size_per_gpu ({micro}) x "
                f"gradient_accumulation_steps ({steps}) x world size ({world_size}), as DeepSpeed requires; "
                "fix the batch keys or the number of processes"
            )
        return micro, steps

    def report(self) -> str | None:
        """One line naming the ignored keys and the notes, or None when there is nothing to say."""
        parts = [f"ignored (they do not change training): {', '.join(self.ignored)}"] if self.ignored else []
        return f"DeepSpeed config {self.source}: " + "; ".join(parts + list(self.notes)) if parts or self.notes else None


def _optimizer(data: Mapping[str, Any], source: str, schedule: DeepSpeedSchedule | None) -> tuple[str, str, dict, dict, list[str]]:
    """``(type, method, params, engine settings, notes)`` of the ``optimizer`` block and the engine keys."""
    block = config_block(data, "optimizer", source)
    if not block:
        raise ValueError(f"DeepSpeed config {source}: optimizer is missing; qaccel runs optimizer.type {_TYPE_NAMES}")
    kind, params = block.pop("type", None), block.pop("params", {})
    if block:
        raise ValueError(f"DeepSpeed config {source}: optimizer.{sorted(block)[0]} is not an optimizer key; allowed: type, params")
    if not isinstance(kind, str) or kind.lower() not in DEEPSPEED_OPTIMIZERS:
        raise ValueError(f"DeepSpeed config {source}: optimizer.type={kind!r} is not supported; allowed: {_TYPE_NAMES}")
    if not isinstance(params, Mapping):
        raise ValueError(f"DeepSpeed config {source}: optimizer.params must be an object, got {params!r}")
    if "gradient_clipping" in params:  # DeepSpeed passes params to the optimizer, which has no such argument
        raise ValueError(f"DeepSpeed config {source}: optimizer.params.gradient_clipping: an engine key; put gradient_clipping at the top level")
    engine, notes = {}, []
    if "gradient_clipping" in data:
        engine["gradient_clipping"] = data["gradient_clipping"]
    if schedule is not None:  # DeepSpeed's scheduler sets each group's lr, so its peak is the run's lr
        if "lr" in params and params["lr"] != schedule.peak_lr:
            notes.append(f"optimizer.params.lr={params['lr']!r} is replaced by scheduler.params.warmup_max_lr={schedule.peak_lr!r}, as in DeepSpeed")
        engine["lr"] = schedule.peak_lr
    return kind, DEEPSPEED_OPTIMIZERS[kind.lower()], dict(params), engine, notes


def read_deepspeed_config(ds: str | os.PathLike | Mapping[str, Any]) -> DeepSpeedConfig:
    """Read a DeepSpeed config (a JSON file, or the dict ``json.load`` gives) as qaccel runs it.

    Args:
        ds: the config: a path (trailing commas allowed, as DeepSpeed's hjson reader allows them) or a mapping.

    Returns:
        The :class:`DeepSpeedConfig`: optimizer settings, batch keys, precision, schedule, ignored keys.

    Raises:
        TypeError: ``ds`` is neither a path nor a mapping.
        ValueError: an unreadable file, an optimizer type other than ZeroOneAdam / OneBitAdam (any case), an
            engine key qaccel cannot honour (ZeRO stage > 0, a log-shaped warm-up, ...) or a bad engine value,
            naming the key (``optimizer.params`` are checked by :meth:`DeepSpeedConfig.optimizer_config`).

    Example::

        ds = read_deepspeed_config("ds_config.json")
        config = ds.optimizer_config(ZeroOneAdamConfig)
        micro, accumulation = ds.batch(world_size=accelerator.num_processes)
    """
    data, source = load_deepspeed(ds)
    ignored = accepted_keys(data, source)
    schedule = read_schedule(data, source)
    kind, method, params, engine, notes = _optimizer(data, source, schedule)
    return DeepSpeedConfig(
        source=source,
        optimizer_type=kind,
        method=method,
        params=params,
        engine_settings=engine,
        train_batch_size=positive_int(data, "train_batch_size", source),
        micro_batch_size=positive_int(data, "train_micro_batch_size_per_gpu", source),
        gradient_accumulation_steps=positive_int(data, "gradient_accumulation_steps", source),
        mixed_precision=read_precision(data, source),
        schedule=schedule,
        ignored=tuple(ignored),
        notes=tuple(notes),
    )


def _script_settings(ds: DeepSpeedConfig) -> list[str]:
    """The engine settings a script applies itself (``qaccel train --deepspeed_config`` applies them)."""
    settings = [f"{key}={value}" for key, value in (
        ("train_batch_size", ds.train_batch_size), ("train_micro_batch_size_per_gpu", ds.micro_batch_size),
        ("gradient_accumulation_steps", ds.gradient_accumulation_steps), ("mixed_precision", ds.mixed_precision),
    ) if value is not None]  # fmt: skip
    if ds.schedule is not None:
        settings.append(f"lr schedule {ds.schedule.name} with {ds.schedule.warmup_steps} warm-up steps"
                        + (f" over {ds.schedule.total_steps} steps" if ds.schedule.total_steps else ""))  # fmt: skip
    return settings


def optimizer_config_from_deepspeed(cls: type[_C], ds: str | os.PathLike | Mapping[str, Any]) -> _C:
    """``cls.from_deepspeed(ds)``: the optimizer config of a DeepSpeed config, refusing another optimizer type.

    Warns once (``UserWarning``) with the ignored keys and the engine settings the script applies itself.

    Raises:
        ValueError: as :func:`read_deepspeed_config`, or an ``optimizer.type`` that is not ``cls``'s.
    """
    ds = read_deepspeed_config(ds)
    config = ds.optimizer_config(cls)
    lines = [line for line in (ds.report(),) if line]
    settings = _script_settings(ds)
    if settings:
        lines.append(f"not applied by {cls.__name__}.from_deepspeed (apply them in your script): {', '.join(settings)}")
    if lines:
        warnings.warn("; ".join(lines), UserWarning, stacklevel=3)
    return config
