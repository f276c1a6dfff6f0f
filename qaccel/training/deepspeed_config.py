"""``--deepspeed_config ds.json``: a DeepSpeed config as the training entry's settings, checked before launch.

The JSON is the source of truth for what it sets: its ``optimizer.type`` picks the method, its
``optimizer.params`` and ``gradient_clipping`` become the optimizer's settings (as ``--zoadam_*``
flags would: above the environment and the recipe), and its batch, precision and scheduler keys become
``--per_device_batch_size``, ``--gradient_accumulation_steps``, ``--mixed_precision``, ``--learning_rate``,
``--weight_decay``, ``--warmup_steps``, ``--lr_scheduler`` and ``--max_steps``. A flag given on the command
line that says otherwise is refused, naming both; the same value is accepted. What the JSON leaves out
comes from the flags, the recipe and the defaults as usual. :mod:`qaccel.optim.deepspeed_json` reads it.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from .._errors import UsageError
from ..optim.config import OneBitAdamConfig, OneBitConfigBase, ZeroOneAdamConfig
from ..optim.deepspeed_json import DeepSpeedConfig, read_deepspeed_config
from .faults import RESUME_COMMAND_ENV

__all__ = ["add_deepspeed_flag", "apply_deepspeed_config", "with_deepspeed_method"]

logger = logging.getLogger(__name__)
_CONFIGS = {cls.RECIPE_SECTION: cls for cls in (ZeroOneAdamConfig, OneBitAdamConfig)}  # method -> config class
_ENGINE_ORIGIN = {"gradient_clipping": "gradient_clipping", "lr": "scheduler.params.warmup_max_lr"}  # engine keys' fields


def add_deepspeed_flag(parser: argparse.ArgumentParser) -> None:
    """``--deepspeed_config PATH`` on the training entry's parser."""
    parser.add_argument(
        "--deepspeed_config",
        help="a DeepSpeed config JSON (ZeroOneAdam or OneBitAdam): sets the method, its optimizer settings, batch, "
        "accumulation, clipping, precision and warm-up; conflicting flags are refused (docs/from_deepspeed.md)",
    )


def _refuse_method(args: argparse.Namespace, ds: DeepSpeedConfig) -> None:
    if args.method is not None and args.method != ds.method:
        raise UsageError(
            f"--method {args.method} conflicts with --deepspeed_config {ds.source}: its optimizer.type "
            f"{ds.optimizer_type!r} runs --method {ds.method}; drop --method (or change the JSON's optimizer.type)"
        )


def with_deepspeed_method(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with ``--method`` set from the JSON's optimizer type (for the launcher's choice of launch config).

    Raises:
        UsageError: ``--method`` names another method.
        ValueError: the JSON cannot be read or run (see :func:`qaccel.optim.deepspeed_json.read_deepspeed_config`).
    """
    if getattr(args, "deepspeed_config", None) is None:
        return args
    ds = read_deepspeed_config(args.deepspeed_config)
    _refuse_method(args, ds)
    return argparse.Namespace(**{**vars(args), "method": ds.method})


def _training_values(ds: DeepSpeedConfig, optimizer: OneBitConfigBase, world_size: int) -> dict[str, tuple[Any, str]]:
    """``{flag name: (value, the JSON key it comes from)}`` for the training settings the JSON sets."""
    values: dict[str, tuple[Any, str]] = {}
    micro, steps = ds.batch(world_size)
    if micro is not None:
        values["per_device_batch_size"] = (micro, "train_micro_batch_size_per_gpu")
    if steps is not None:
        values["gradient_accumulation_steps"] = (steps, "gradient_accumulation_steps")
    if ds.mixed_precision is not None:
        values["mixed_precision"] = (ds.mixed_precision, "fp16/bf16.enabled")
    if "lr" in ds.optimizer_keys:  # the schedule and the record follow the optimizer's lr
        source = "scheduler.params.warmup_max_lr" if ds.schedule is not None else "optimizer.params.lr"
        values["learning_rate"] = (optimizer.lr, source)
    if "weight_decay" in ds.optimizer_keys:  # the param groups carry it (biases and norms excluded)
        values["weight_decay"] = (optimizer.weight_decay, "optimizer.params.weight_decay")
    if ds.schedule is not None:
        values["lr_scheduler"] = (ds.schedule.name, "scheduler.type")
        values["warmup_steps"] = (ds.schedule.warmup_steps, "scheduler.params.warmup_num_steps")
        if ds.schedule.total_steps is not None:
            values["max_steps"] = (ds.schedule.total_steps, "scheduler.params.total_num_steps")
    return values


def _report_once(ds: DeepSpeedConfig) -> None:
    """Log the ignored keys once: from ``qaccel train``'s launcher or a lone process, not again from its ranks."""
    line = ds.report()
    launched_by_qaccel_train = os.environ.get(RESUME_COMMAND_ENV) is not None  # the launcher said it already
    is_main = os.environ.get("RANK", "0") == "0"
    if line is not None and is_main and not launched_by_qaccel_train:
        logger.warning(line)


def apply_deepspeed_config(args: argparse.Namespace, *, world_size: int) -> argparse.Namespace:
    """``args`` with the settings of ``--deepspeed_config`` (a copy; ``args`` itself is unchanged).

    Args:
        args: the training entry's parsed flags.
        world_size: the processes of the run (checks ``train_batch_size`` as DeepSpeed does).

    Raises:
        UsageError: a flag given on the command line contradicts the JSON, naming both.
        ValueError: the JSON cannot be read or run, naming the key and what is allowed.
    """
    if getattr(args, "deepspeed_config", None) is None:
        return args
    ds = read_deepspeed_config(args.deepspeed_config)
    _refuse_method(args, ds)
    optimizer = ds.optimizer_config(_CONFIGS[ds.method])  # optimizer.params checked here, before any process starts
    settings = {"method": ds.method}
    given = vars(args)
    for name, (value, key) in _training_values(ds, optimizer, world_size).items():
        if given.get(name) is not None and given[name] != value:
            raise UsageError(f"--{name} {given[name]} conflicts with {key}={value!r} in --deepspeed_config {ds.source}; drop the flag or edit the JSON")
        settings[name] = value
    for key in ds.optimizer_keys:  # --zoadam_<field>: absent from args when not given
        flag, value = f"zoadam_{key}", getattr(optimizer, key)
        if flag in given and given[flag] != value:
            origin = _ENGINE_ORIGIN[key] if key in ds.engine_settings else f"optimizer.params.{key}"
            raise UsageError(f"--{flag} {given[flag]} conflicts with {origin}={value!r} in --deepspeed_config {ds.source}; drop the flag or edit the JSON")
        settings[flag] = value
    _report_once(ds)
    return argparse.Namespace(**{**given, **settings})
