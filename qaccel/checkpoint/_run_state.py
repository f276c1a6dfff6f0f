"""``qaccel_state.json`` and ``hf_model/``: how a checkpoint was trained, written next to Accelerate's files.

- ``qaccel_state.json`` (:data:`RUN_STATE_FILE`): the method, its full config, recipe, task,
  optimizer step, world size, bytes on the wire and versions. Resuming compares it with the new
  run (``qaccel.training.check_resume``); ``qaccel export`` copies it into the exported model's
  metadata.
- ``hf_model/`` (:data:`MODEL_FILES_DIR`): ``config.json``, ``generation_config.json`` and the
  tokenizer files, so the checkpoint alone is enough to rebuild a Hugging Face model folder.

The schema is described in ``docs/export.md``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
from pathlib import Path
from typing import Any

from .._version import __version__
from ._atomic import atomic_write_json, install_dir, staging_dir
from ._layout import MODEL_FILES_DIR, RUN_STATE_FILE
from ._vetted import read_json

SCHEMA_VERSION = 1

#: the ``method`` values of the schema -> Hub tag of an export (``None``: no method-specific tag)
METHODS: dict[str, str | None] = {"qsdp": "qsdp", "zero_one_adam": "0-1-adam", "onebit_adam": "1-bit-adam", "diloco": "diloco", "none": None}
#: the ``task`` values of the schema -> (transformers auto class an export builds, Hub pipeline tag)
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

    Usually the ``write_extra`` of :func:`qaccel.checkpoint.save_checkpoint`, which then lists them
    in the manifest. Only the main process (global rank 0, or a run without a process group)
    writes; other ranks return at once, so calling it on every rank is harmless. Both are written
    atomically: the JSON through a flushed temporary file and a rename, ``hf_model/`` as a staged
    folder renamed into place.

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
    check_run_state(run_state, "run_state")
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
        install_dir(staged, root / MODEL_FILES_DIR)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    atomic_write_json(root / RUN_STATE_FILE, run_state)


def check_run_state(state: Any, where: str) -> None:
    """Check that ``state`` is a run-state object with every required key.

    Raises:
        ValueError: not a dict, or missing keys (named), attributed to ``where``.
    """
    if not isinstance(state, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(state).__name__}")
    missing = [key for key in _REQUIRED if key not in state]
    if missing:
        raise ValueError(f"{where}: missing keys {missing} (a qaccel run state needs {list(_REQUIRED)})")


def run_state_path(checkpoint_dir: str | os.PathLike) -> Path:
    """``checkpoint_dir/qaccel_state.json``, which must exist.

    Raises:
        FileNotFoundError: the folder or the file does not exist (naming the path).
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
    return path


def read_run_state(checkpoint_dir: str | os.PathLike) -> dict:
    """Read and check ``qaccel_state.json`` of a checkpoint folder.

    Raises:
        FileNotFoundError: the folder or its ``qaccel_state.json`` does not exist (naming the path).
        ValueError: the file is not valid JSON, lacks required keys, names an unknown method or
            task, or has a newer schema than this qaccel understands.
    """
    path = run_state_path(checkpoint_dir)
    state = read_json(path)
    check_run_state(state, str(path))
    if not _is_int(state["schema_version"]) or state["schema_version"] > SCHEMA_VERSION:
        raise ValueError(
            f"{path}: schema_version={state['schema_version']!r}; this qaccel ({__version__}) reads up to {SCHEMA_VERSION}"
        )
    if state["method"] not in METHODS:
        raise ValueError(f"{path}: method={state['method']!r}: must be one of {sorted(METHODS)}")
    if state["task"] not in TASKS:
        raise ValueError(f"{path}: task={state['task']!r}: must be one of {sorted(TASKS)}")
    return state
