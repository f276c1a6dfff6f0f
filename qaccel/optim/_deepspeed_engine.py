"""The engine keys of a DeepSpeed config: file reading, batch, precision and scheduler blocks, accepted keys.

The pieces :mod:`qaccel.optim.deepspeed_json` puts together; each function raises ``ValueError`` naming the
key, its value and what is allowed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "IGNORED_KEYS",
    "DeepSpeedSchedule",
    "accepted_keys",
    "config_block",
    "load_deepspeed",
    "positive_int",
    "read_precision",
    "read_schedule",
]

# Keys that only log, monitor or profile: they change nothing in training, so they are accepted and reported.
IGNORED_KEYS = (
    "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state", "tensorboard", "wandb",
    "csv_monitor", "comet", "comms_logger", "flops_profiler", "timers", "zero_allow_untested_optimizer",
)  # fmt: skip
# Keys accepted only with the value that describes what happens here (DeepSpeed's defaults).
_DEFAULT_ONLY: dict[str, tuple[Any, str]] = {
    "prescale_gradients": (False, "false: gradients are averaged after the all-reduce"),
    "gradient_predivide_factor": (1.0, "1.0: gradients are averaged after the all-reduce"),
    "sparse_gradients": (False, "false: every gradient travels dense"),
}
_ENGINE_KEYS = ("optimizer", "gradient_clipping", "train_batch_size", "train_micro_batch_size_per_gpu",
                "gradient_accumulation_steps", "fp16", "bf16", "amp", "scheduler", "zero_optimization")  # fmt: skip
# fp16 loss scaling: Accelerate's torch GradScaler (init 2**16, growth every 2000 steps, no hysteresis,
# no floor). A DeepSpeed key is accepted only with the value that GradScaler matches.
_FP16_KEYS: dict[str, tuple[Any, str]] = {
    "loss_scale": (0, "0 (dynamic loss scaling, torch's GradScaler)"),
    "initial_scale_power": (16, "16 (GradScaler starts at 2**16)"),
    "loss_scale_window": (2000, "2000 (GradScaler's growth_interval)"),
    "hysteresis": (1, "1 (GradScaler backs off on the first overflow)"),
    "consecutive_hysteresis": (False, "false (GradScaler has no hysteresis)"),
    "auto_cast": (False, "false (Accelerate's autocast decides each op's dtype)"),
    "fp16_master_weights_and_grads": (False, "false (fp32 weights and gradients; autocast computes in fp16)"),
}
_WARMUP_SCHEDULES = {"WarmupLR": "constant_with_warmup", "WarmupDecayLR": "linear"}  # -> transformers' name


@dataclass(frozen=True)
class DeepSpeedSchedule:
    """A DeepSpeed ``WarmupLR`` / ``WarmupDecayLR`` as a transformers schedule (linear warm-up from 0).

    Attributes:
        name: ``constant_with_warmup`` (WarmupLR) or ``linear`` (WarmupDecayLR: decays to 0 at ``total_steps``).
        warmup_steps: ``warmup_num_steps`` (DeepSpeed's default 1000).
        peak_lr: ``warmup_max_lr`` (default 0.001); DeepSpeed's scheduler overrides ``optimizer.params.lr``.
        total_steps: WarmupDecayLR's ``total_num_steps`` (the run's length), None for WarmupLR.
    """

    name: str
    warmup_steps: int
    peak_lr: float
    total_steps: int | None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object; a repeated key raises, as DeepSpeed's ``dict_raise_error_on_duplicate_keys`` does."""
    keys = [key for key, _ in pairs]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise ValueError(f"duplicate keys {repeated}")
    return dict(pairs)


def _without_trailing_commas(text: str) -> str:
    """``text`` with each comma that closes an object or array dropped (outside strings).

    DeepSpeed reads its config with hjson, which allows them, and the 1-bit Adam tutorial's
    ``"fp16": {"enabled": true,}`` has one: such a file must load here too.
    """
    out: list[str] = []
    in_string = escaped = False
    for i, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char == "," and text[i + 1 :].lstrip()[:1] in ("}", "]"):
            continue
        out.append(char)
    return "".join(out)


def load_deepspeed(ds: str | os.PathLike | Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """``(the config as a dict, where it came from)`` of a path or a mapping; an unreadable file raises ValueError."""
    if isinstance(ds, Mapping):
        return dict(ds), "dict"
    if not isinstance(ds, (str, os.PathLike)):
        raise TypeError(f"DeepSpeed config: expected a path or a dict, got {type(ds).__name__}")
    path = Path(ds)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"DeepSpeed config {str(path)!r}: cannot read it ({err.strerror or err})") from None
    try:
        data = json.loads(_without_trailing_commas(text), object_pairs_hook=_no_duplicates)
    except ValueError as err:  # json.JSONDecodeError, or a duplicate key
        raise ValueError(f"DeepSpeed config {str(path)!r}: not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"DeepSpeed config {str(path)!r}: must hold a JSON object, got {type(data).__name__}")
    return data, str(path)


def config_block(data: Mapping[str, Any], key: str, source: str) -> dict[str, Any]:
    """A copy of the object under ``key`` ({} when absent); anything but an object raises ValueError."""
    value = data.get(key, {})
    if not isinstance(value, Mapping):
        raise ValueError(f"DeepSpeed config {source}: {key} must be an object, got {value!r}")
    return dict(value)


def positive_int(data: Mapping[str, Any], key: str, source: str) -> int | None:
    """The int >= 1 under ``key``, or None when absent; any other value raises ValueError."""
    value = data.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"DeepSpeed config {source}: {key}={value!r} must be an int >= 1")
    return value


def _require(source: str, key: str, value: Any, expected: Any, allowed: str) -> None:
    if value != expected or isinstance(value, bool) != isinstance(expected, bool):
        raise ValueError(f"DeepSpeed config {source}: {key}={value!r} is not supported; allowed: {allowed}")


def read_precision(data: Mapping[str, Any], source: str) -> str | None:
    """``fp16`` / ``bf16`` / ``no`` from the precision blocks (None: none given); other sub-keys refused."""
    enabled = {}
    for name in ("fp16", "bf16", "amp"):
        if name not in data:
            continue
        block = config_block(data, name, source)
        flag = block.pop("enabled", False)
        if not isinstance(flag, bool):
            raise ValueError(f"DeepSpeed config {source}: {name}.enabled={flag!r} must be true or false")
        if name == "amp" and flag:
            raise ValueError(f"DeepSpeed config {source}: amp.enabled=true (NVIDIA apex) is not supported; use fp16 or bf16")
        for key, value in block.items():
            if name != "fp16" or key not in _FP16_KEYS:
                raise ValueError(f"DeepSpeed config {source}: {name}.{key} is not supported; {name} takes only enabled"
                                 + (f", {', '.join(_FP16_KEYS)}" if name == "fp16" else ""))  # fmt: skip
            _require(source, f"fp16.{key}", value, *_FP16_KEYS[key])
        enabled[name] = flag
    if enabled.get("fp16") and enabled.get("bf16"):
        raise ValueError(f"DeepSpeed config {source}: fp16.enabled and bf16.enabled are both true; enable one")
    if not enabled:
        return None
    return next((name for name in ("fp16", "bf16") if enabled.get(name)), "no")


def read_schedule(data: Mapping[str, Any], source: str) -> DeepSpeedSchedule | None:
    """The ``scheduler`` block as a :class:`DeepSpeedSchedule` (None: no block); what it cannot honour raises ValueError."""
    if "scheduler" not in data:
        return None
    block = config_block(data, "scheduler", source)
    kind, params = block.pop("type", None), block.pop("params", {})
    if block:
        raise ValueError(f"DeepSpeed config {source}: scheduler.{sorted(block)[0]} is not a scheduler key; allowed: type, params")
    if kind not in _WARMUP_SCHEDULES:
        raise ValueError(f"DeepSpeed config {source}: scheduler.type={kind!r} is not supported; allowed: {', '.join(_WARMUP_SCHEDULES)}")
    if not isinstance(params, Mapping):
        raise ValueError(f"DeepSpeed config {source}: scheduler.params must be an object, got {params!r}")
    params = dict(params)
    known = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"}
    known |= {"total_num_steps"} if kind == "WarmupDecayLR" else set()
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"DeepSpeed config {source}: scheduler.params.{unknown[0]} is not a {kind} key; allowed: {', '.join(sorted(known))}")
    # transformers' schedules warm up linearly from 0; DeepSpeed's default warm-up is logarithmic.
    _require(source, "scheduler.params.warmup_type", params.get("warmup_type", "log"), "linear",
             "linear (qaccel's warm-up is linear; DeepSpeed's default is log: set warmup_type: linear)")  # fmt: skip
    _require(source, "scheduler.params.warmup_min_lr", params.get("warmup_min_lr", 0), 0, "0 (the warm-up starts at 0)")
    _require(source, "scheduler.params.last_batch_iteration", params.get("last_batch_iteration", -1), -1, "-1 (resume with --resume_from_checkpoint)")
    peak = params.get("warmup_max_lr", 0.001)
    if isinstance(peak, bool) or not isinstance(peak, (int, float)) or peak < 0:
        raise ValueError(f"DeepSpeed config {source}: scheduler.params.warmup_max_lr={peak!r} must be a number >= 0")
    warmup = params.get("warmup_num_steps", 1000)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"DeepSpeed config {source}: scheduler.params.warmup_num_steps={warmup!r} must be an int >= 0")
    total = positive_int(params, "total_num_steps", source) if kind == "WarmupDecayLR" else None
    if kind == "WarmupDecayLR" and total is None:
        total = 1000  # DeepSpeed's default
    return DeepSpeedSchedule(name=_WARMUP_SCHEDULES[kind], warmup_steps=warmup, peak_lr=peak, total_steps=total)


def accepted_keys(data: Mapping[str, Any], source: str) -> list[str]:
    """Check the keys outside the mapped blocks; return the ignored ones (dotted)."""
    ignored = []
    for key, value in data.items():
        if key in _ENGINE_KEYS:
            continue
        if key in IGNORED_KEYS:
            ignored.append(key)
        elif key in _DEFAULT_ONLY:
            _require(source, key, value, *_DEFAULT_ONLY[key])
        else:
            raise ValueError(
                f"DeepSpeed config {source}: {key} is not supported by qaccel; mapped keys: {', '.join(_ENGINE_KEYS)}; "
                f"ignored: {', '.join(IGNORED_KEYS)}; accepted at their defaults: {', '.join(_DEFAULT_ONLY)}"
            )
    zero = config_block(data, "zero_optimization", source)
    if zero:
        _require(source, "zero_optimization.stage", zero.pop("stage", 0), 0,
                 "0 (qaccel's 1-bit optimizers keep full optimizer state on every rank; shard with an HSDP launch instead)")  # fmt: skip
        ignored += [f"zero_optimization.{key}" for key in zero]  # bucket sizes etc. of a stage that is off
    return ignored
