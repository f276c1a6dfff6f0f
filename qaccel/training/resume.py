"""Which runs may resume from a checkpoint: the policy over the format's ``qaccel_state.json``.

The checkpoint format (``qaccel.checkpoint``) says what a run state holds; this module decides
what a resumed run may change: nothing that changes the results (method, method config, task,
recipe, base model), while the world size and the qaccel version only warn, naming what changes.
"""

from __future__ import annotations

import json

from ..checkpoint import check_run_state
from ..fsdp.config import SPEED_ONLY_FIELDS

__all__ = ["check_resume"]

# Method settings added after checkpoints were first written, with the value every older run had: a
# checkpoint without the key was trained with it (1-bit optimizers: DeepSpeed's uncorrected variance).
_ADDED_LATER = {"variance_bias_correction": False}


def _config_differences(saved: dict, current: dict) -> list[str]:
    # Compared as JSON reads them back: a tuple in a config object equals the list read from disk.
    saved, current = json.loads(json.dumps(saved)), json.loads(json.dumps(current))
    missing = object()
    show = lambda value: "(absent)" if value is missing else json.dumps(value)  # noqa: E731
    lines = []
    for key in sorted(set(saved) | set(current)):
        if key in SPEED_ONLY_FIELDS:  # e.g. QSDP prefetch: changes the speed of a step, not its results
            continue
        before, after = saved.get(key, _ADDED_LATER.get(key, missing)), current.get(key, missing)
        if before != after:
            lines.append(f"{key}: checkpoint {show(before)}, this run {show(after)}")
    return lines


def _world_size_warning(method: str, before: int, after: int, config: dict | None = None) -> str:
    change = f"world size {before} -> {after}"
    if method == "qsdp":
        feedback = (config or {}).get("grad_error_feedback")
        state = (
            "QSDP's per-rank gradient error-feedback buffers cannot be redistributed and restart from zero; otherwise "
            if feedback
            else "QSDP keeps no per-rank state, so "
        )
        return (
            f"{change}: {state}the sharded weights and optimizer state are re-sharded on load "
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
        saved: ``read_run_state`` (or ``open_checkpoint``) of the checkpoint.
        current: ``build_run_state`` of the new run.

    Returns:
        Warnings (possibly none) for differences that are safe but change something: the world size
        (what changes depends on the method) and the qaccel version.

    Raises:
        ValueError: the method, any key of the method config, the task, the recipe, or the base
            model differ, or a DiLoCo run's world size does; the message names the key and both values.
    """
    check_run_state(saved, "check_resume saved state")
    check_run_state(current, "check_resume current state")
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
    if saved["method"] == "diloco" and saved["world_size"] != current["world_size"]:
        raise ValueError(
            f"resume: the checkpoint was trained with method 'diloco' on {saved['world_size']} processes, this run has "
            f"{current['world_size']}: each rank's island state (inner optimizer, error feedback, global weight shards) "
            f"cannot be redistributed; resume on {saved['world_size']} processes"
        )
    warnings = []
    if saved["world_size"] != current["world_size"]:
        warnings.append(_world_size_warning(saved["method"], saved["world_size"], current["world_size"], saved.get("method_config")))
    if saved["qaccel_version"] != current["qaccel_version"]:
        warnings.append(f"the checkpoint was written by qaccel {saved['qaccel_version']}, this is qaccel {current['qaccel_version']}")
    return warnings
