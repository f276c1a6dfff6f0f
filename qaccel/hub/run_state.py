"""``qaccel_state.json``: how a training checkpoint was made, written next to Accelerate's files.

A checkpoint folder (``checkpoint-STEP/``) holds what ``accelerator.save_state`` writes plus two
things qaccel adds on the main process:

- ``qaccel_state.json`` (:data:`RUN_STATE_FILE`): the method, its full config, recipe, task,
  optimizer step, world size, bytes on the wire and versions. Resuming compares it with the new
  run (:func:`check_resume`); ``qaccel export`` copies it into the exported model's metadata.
- ``hf_model/`` (:data:`MODEL_FILES_DIR`): ``config.json``, ``generation_config.json`` and the
  tokenizer files, so the checkpoint alone is enough to rebuild a Hugging Face model folder.

The schema is described in ``docs/export.md``.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import shutil
from pathlib import Path
from typing import Any

from .._version import __version__
from ..fsdp.config import SPEED_ONLY_FIELDS
from ._fs import fsync_dir, fsync_tree, staging_dir, write_text_atomic

__all__ = [
    "RUN_STATE_FILE",
    "MODEL_FILES_DIR",
    "SCHEMA_VERSION",
    "METHODS",
    "TASKS",
    "build_run_state",
    "save_checkpoint_metadata",
    "read_run_state",
    "check_resume",
]

logger = logging.getLogger(__name__)

RUN_STATE_FILE = "qaccel_state.json"
MODEL_FILES_DIR = "hf_model"
SCHEMA_VERSION = 1

#: method name -> Hub tag (``None``: no method-specific tag)
METHODS: dict[str, str | None] = {"qsdp": "qsdp", "zero_one_adam": "0-1-adam", "onebit_adam": "1-bit-adam", "none": None}
#: task -> (transformers auto class, Hub pipeline tag)
TASKS: dict[str, tuple[str, str]] = {
    "causal-lm": ("AutoModelForCausalLM", "text-generation"),
    "masked-lm": ("AutoModelForMaskedLM", "fill-mask"),
    "sequence-classification": ("AutoModelForSequenceClassification", "text-classification"),
}
_REQUIRED = ("schema_version", "qaccel_version", "method", "method_config", "recipe", "task", "step", "world_size", "wire_bytes_total")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_roundtrip(value: Any, what: str) -> Any:
    """``value`` as it will read back from JSON (tuples become lists); refuses what JSON cannot hold."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as err:
        raise ValueError(f"run state {what}: not JSON-serializable ({err})") from None


def _versions() -> dict[str, str | None]:
    import accelerate
    import torch
    import transformers

    return {
        "qaccel": __version__,
        "torch": torch.__version__,
        "accelerate": accelerate.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def build_run_state(
    *,
    method: str,
    method_config: dict,
    recipe: str | None,
    task: str,
    step: int,
    world_size: int,
    wire_bytes_total: int,
    baseline_wire_bytes_total: int | None = None,
    metrics: dict | None = None,
    base_model: str | None = None,
    dataset: str | None = None,
    extra: dict | None = None,
) -> dict:
    """The ``qaccel_state.json`` record of a run at one optimizer step.

    Args:
        method: ``qsdp``, ``zero_one_adam``, ``onebit_adam`` or ``none``.
        method_config: the method's full config (``QSDPConfig.to_dict()``, ``ZeroOneAdamConfig.to_dict()``,
            ...); compared key by key on resume, published as ``qaccel_config`` on export.
        recipe: the recipe name, or ``None`` for a run without one.
        task: ``causal-lm``, ``masked-lm`` or ``sequence-classification``; decides the
            ``AutoModelFor*`` class the export builds.
        step: optimizer steps completed.
        world_size: number of data-parallel processes.
        wire_bytes_total: bytes the run sent on the wire so far, as its training script measured them.
        baseline_wire_bytes_total: the same for the uncompressed baseline (stock FSDP2 / DDP), if known.
        metrics: the latest evaluation results (name -> number), shown in the model card.
        base_model: the Hub id (or path) the run was fine-tuned from; ``None`` when trained from scratch.
        dataset: the dataset name.
        extra: anything else JSON-serializable the script wants kept (hyperparameters, ...).

    Returns:
        A JSON-ready dict that also records the qaccel/torch/accelerate/transformers versions,
        ``schema_version`` and the creation time (UTC).

    Raises:
        ValueError: an unknown method or task, a negative count, or values JSON cannot hold.
        TypeError: a count that is not an int, or a config that is not a dict.
    """
    if method not in METHODS:
        raise ValueError(f"run state method={method!r}: must be one of {sorted(METHODS)}")
    if task not in TASKS:
        raise ValueError(f"run state task={task!r}: must be one of {sorted(TASKS)}")
    if not isinstance(method_config, dict):
        raise TypeError(f"run state method_config: expected a dict, got {type(method_config).__name__}")
    for name, value, minimum in (("step", step, 0), ("world_size", world_size, 1), ("wire_bytes_total", wire_bytes_total, 0)):
        if not _is_int(value):
            raise TypeError(f"run state {name}={value!r}: expected an int")
        if value < minimum:
            raise ValueError(f"run state {name}={value}: must be >= {minimum}")
    if baseline_wire_bytes_total is not None and (not _is_int(baseline_wire_bytes_total) or baseline_wire_bytes_total < 0):
        raise ValueError(f"run state baseline_wire_bytes_total={baseline_wire_bytes_total!r}: must be an int >= 0 or None")
    for name, value in (("recipe", recipe), ("base_model", base_model), ("dataset", dataset)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"run state {name}={value!r}: expected a str or None")
    state = {
        "schema_version": SCHEMA_VERSION,
        "qaccel_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "method": method,
        "method_config": method_config,
        "recipe": recipe,
        "task": task,
        "step": step,
        "world_size": world_size,
        "wire_bytes_total": wire_bytes_total,
        "baseline_wire_bytes_total": baseline_wire_bytes_total,
        "metrics": dict(metrics) if metrics else {},
        "base_model": base_model,
        "dataset": dataset,
        "versions": _versions(),
        "extra": dict(extra) if extra else {},
    }
    return _json_roundtrip(state, "")


def _is_main_process() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def save_checkpoint_metadata(checkpoint_dir: str | os.PathLike, *, run_state: dict, model_config: Any, tokenizer: Any = None, generation_config: Any = None) -> None:
    """Write ``qaccel_state.json`` and ``hf_model/`` into a checkpoint folder.

    Call it after ``accelerator.save_state(checkpoint_dir)``. Only the main process (global rank 0,
    or a run without a process group) writes; other ranks return at once, so calling it on every
    rank is harmless. Both are written atomically: the JSON through a flushed temporary file and a
    rename, ``hf_model/`` as a staged folder renamed into place.

    Args:
        run_state: from :func:`build_run_state`.
        model_config: the model's ``PretrainedConfig`` (``unwrapped_model.config``).
        tokenizer: a tokenizer with ``save_pretrained``, if the run has one.
        generation_config: a ``GenerationConfig``, for generative models.

    Raises:
        TypeError: ``model_config`` has no ``save_pretrained`` (not a transformers config).
        ValueError: ``run_state`` lacks required keys.
    """
    if not _is_main_process():
        return
    _check_required(run_state, "run_state")
    if not hasattr(model_config, "save_pretrained"):
        raise TypeError(f"save_checkpoint_metadata: model_config must be a transformers PretrainedConfig, got {type(model_config).__name__}")
    root = Path(checkpoint_dir)
    root.mkdir(parents=True, exist_ok=True)
    staged = staging_dir(root / MODEL_FILES_DIR, "write")
    try:
        model_config.save_pretrained(staged)
        if generation_config is not None:
            generation_config.save_pretrained(staged)
        if tokenizer is not None:
            tokenizer.save_pretrained(staged)
        fsync_tree(staged)
        target = root / MODEL_FILES_DIR
        if target.exists():
            shutil.rmtree(target)
        os.replace(staged, target)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    write_text_atomic(root / RUN_STATE_FILE, json.dumps(run_state, indent=2, sort_keys=True) + "\n")


def _check_required(state: Any, where: str) -> None:
    if not isinstance(state, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(state).__name__}")
    missing = [key for key in _REQUIRED if key not in state]
    if missing:
        raise ValueError(f"{where}: missing keys {missing} (a qaccel run state needs {list(_REQUIRED)})")


def read_run_state(checkpoint_dir: str | os.PathLike) -> dict:
    """Read and check ``qaccel_state.json`` of a checkpoint folder.

    Raises:
        FileNotFoundError: the folder or its ``qaccel_state.json`` does not exist (naming the path).
        ValueError: the file is not valid JSON, lacks required keys, names an unknown method or
            task, or has a newer schema than this qaccel understands.
    """
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such checkpoint folder")
    path = root / RUN_STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: not found; {root} is not a qaccel training checkpoint (training writes {RUN_STATE_FILE} "
            "with save_checkpoint_metadata after accelerator.save_state)"
        )
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err}); the file is truncated or corrupted") from None
    _check_required(state, str(path))
    if not _is_int(state["schema_version"]) or state["schema_version"] > SCHEMA_VERSION:
        raise ValueError(
            f"{path}: schema_version={state['schema_version']!r}; this qaccel ({__version__}) reads up to {SCHEMA_VERSION}"
        )
    if state["method"] not in METHODS:
        raise ValueError(f"{path}: method={state['method']!r}: must be one of {sorted(METHODS)}")
    if state["task"] not in TASKS:
        raise ValueError(f"{path}: task={state['task']!r}: must be one of {sorted(TASKS)}")
    return state


def _config_differences(saved: dict, current: dict) -> list[str]:
    saved, current = _json_roundtrip(saved, "method_config"), _json_roundtrip(current, "method_config")
    missing = object()
    lines = []
    for key in sorted(set(saved) | set(current)):
        if key in SPEED_ONLY_FIELDS:  # e.g. QSDP prefetch: changes the speed of a step, not its results
            continue
        before, after = saved.get(key, missing), current.get(key, missing)
        if before != after:
            show = lambda v: "(absent)" if v is missing else json.dumps(v)  # noqa: E731
            lines.append(f"{key}: checkpoint {show(before)}, this run {show(after)}")
    return lines


def _world_size_warning(method: str, before: int, after: int) -> str:
    change = f"world size {before} -> {after}"
    if method == "qsdp":
        return (
            f"{change}: QSDP keeps no per-rank state, so the sharded weights and optimizer state are re-sharded on load "
            "and the seed step counter continues; what changes is the shard each rank owns (so the quantization "
            f"buckets and their rounding noise differ from a run at world size {before}) and, at the same per-device "
            "batch size, the global batch"
        )
    if method in ("zero_one_adam", "onebit_adam"):
        return (
            f"{change}: the 1-bit optimizer's per-rank error-feedback buffers (worker/server errors, and u for 0/1 Adam) "
            "cannot be redistributed; on load they are reset to zero and weights and momentum are averaged in full "
            "precision, so the first steps after the resume compress without error feedback; at the same per-device "
            "batch size the global batch changes too"
        )
    return f"{change}: at the same per-device batch size the global batch changes"


def check_resume(saved: dict, current: dict) -> list[str]:
    """Compare a checkpoint's run state with the run about to resume from it.

    Args:
        saved: :func:`read_run_state` of the checkpoint.
        current: :func:`build_run_state` of the new run.

    Returns:
        Warnings (possibly none) for differences that are safe but change something: the world size
        (what changes depends on the method) and the qaccel version.

    Raises:
        ValueError: the method, any key of the method config, the task, the recipe, or the base
            model differ; the message names the key and both values.
    """
    _check_required(saved, "check_resume saved state")
    _check_required(current, "check_resume current state")
    if saved["method"] != current["method"]:
        raise ValueError(
            f"resume: the checkpoint was trained with method {saved['method']!r}, this run uses {current['method']!r}; "
            "resume with the same method or start a new run"
        )
    differences = _config_differences(saved["method_config"], current["method_config"])
    if differences:
        raise ValueError(f"resume: the {saved['method']} config differs from the checkpoint's: " + "; ".join(differences))
    for key in ("task", "recipe", "base_model"):
        if saved.get(key) != current.get(key):
            raise ValueError(f"resume: {key} differs: checkpoint {saved.get(key)!r}, this run {current.get(key)!r}")
    warnings = []
    if saved["world_size"] != current["world_size"]:
        warnings.append(_world_size_warning(saved["method"], saved["world_size"], current["world_size"]))
    if saved["qaccel_version"] != current["qaccel_version"]:
        warnings.append(f"the checkpoint was written by qaccel {saved['qaccel_version']}, this is qaccel {current['qaccel_version']}")
    return warnings
