"""Whole-checkpoint operations: save (the one writer), open (verify, then read), rotate."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._atomic import install_dir, remove_dir
from ._layout import CHECKPOINT_PREFIX, MANIFEST_FILE, PARTIAL_SUFFIX, checkpoint_path, list_checkpoints, partial_path
from ._manifest import verify_checkpoint, write_manifest
from ._run_state import read_run_state, run_state_path

logger = logging.getLogger(__name__)


def check_save_total_limit(value: Any, source: str = "save_total_limit") -> int | None:
    """Validate a checkpoint limit: ``None`` (keep every checkpoint) or an int >= 1; return it.

    Args:
        value: the limit.
        source: where it came from, for the message (``--save_total_limit``, ...).

    Raises:
        TypeError: not an int (a bool is not one either).
        ValueError: 0 or negative.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{source}={value!r}: expected an int >= 1, or None to keep every checkpoint")
    if value < 1:
        raise ValueError(
            f"{source}={value}: must be >= 1 (how many of the newest complete checkpoints to keep; the newest "
            "is never deleted); leave it unset to keep every checkpoint"
        )
    return value


def rotate_checkpoints(output_dir: str | os.PathLike, limit: int, *, newest: str | os.PathLike | None = None) -> list[Path]:
    """Delete the oldest complete checkpoints under ``output_dir`` so that ``limit`` remain.

    Only complete checkpoints (with a manifest) count and are ever deleted: a hidden partial folder
    another rank may still be writing, or a ``checkpoint-STEP`` without a manifest, is left alone.
    Checkpoints are ordered by step, except that ``newest`` (the one just written, which may have a
    lower step than others after a resume from an older checkpoint) counts as the newest. The newest
    is never deleted. Each deleted folder is first renamed aside, so a crash never leaves one
    half-deleted under its own name.

    Call it on the main process only, after every rank finished writing the new checkpoint
    (:func:`save_checkpoint` does).

    Args:
        output_dir: the run's output folder.
        limit: how many complete checkpoints to keep (>= 1).
        newest: the checkpoint just written, if any.

    Returns:
        The deleted folders, oldest first.

    Raises:
        TypeError, ValueError: a bad ``limit`` (see :func:`check_save_total_limit`).
    """
    check_save_total_limit(limit, "rotate_checkpoints limit")
    ordered = [path for _, path in list_checkpoints(output_dir)]
    if newest is not None:  # by name: every candidate is a child of output_dir
        ordered.sort(key=lambda path: path.name == Path(newest).name)  # stable: step order otherwise
    doomed = ordered[:-limit]
    for path in doomed:
        remove_dir(path)
        logger.info("deleted %s (save_total_limit=%d)", path, limit)
    return doomed


def remove_partial_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Delete what an interrupted save or rotation left under ``output_dir``; return the folders removed.

    These are the hidden ``.checkpoint-STEP.partial`` folders (a save that never finished; the next
    save of that step would delete it anyway) and ``.checkpoint-STEP.deleting-*`` folders (already
    renamed aside by :func:`rotate_checkpoints`). Complete checkpoints are never touched. Call it
    only when no rank is writing: after an interrupt, or before a run starts.
    """
    root = Path(output_dir)
    if not root.is_dir():
        return []
    doomed = [
        child
        for child in sorted(root.iterdir())
        if child.name.startswith("." + CHECKPOINT_PREFIX)
        and (child.name.endswith(PARTIAL_SUFFIX) or ".deleting-" in child.name)
        and child.is_dir()
        and not child.is_symlink()
    ]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def save_checkpoint(
    accelerator: Any,
    output_dir: str | os.PathLike,
    step: int,
    write_extra: Callable[[Path], None] | None = None,
    *,
    save_total_limit: int | None = None,
) -> Path:
    """Save the full training state as ``checkpoint-STEP`` atomically; every rank must call it.

    Every rank writes into the hidden partial folder (``accelerator.save_state``); once all have
    finished, the main process adds ``write_extra``'s files, writes the manifest and renames the
    folder into place (replacing a same-step checkpoint of a resumed run whole), then deletes the
    oldest checkpoints beyond ``save_total_limit``. A crash at any point leaves the previous
    checkpoint as the latest complete one.

    Args:
        accelerator: the run's Accelerator (its ``save_state`` writes the model, optimizer,
            scheduler, RNG and registered state; qaccel's hooks add per-rank optimizer files).
        output_dir: the run's output folder.
        step: the optimizer step; names the folder.
        write_extra: called on the main process with the partial folder before the manifest is
            written (``save_checkpoint_metadata``: qaccel_state.json, hf_model/).
        save_total_limit: keep only this many complete checkpoints (see :func:`rotate_checkpoints`);
            ``None`` keeps all.

    Returns:
        The ``checkpoint-STEP`` folder.

    Raises:
        TypeError, ValueError: a bad ``save_total_limit``, before anything is written.
    """
    check_save_total_limit(save_total_limit)
    final, partial = checkpoint_path(output_dir, step), partial_path(output_dir, step)
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)  # left by a crash during an earlier save
        partial.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))
    accelerator.wait_for_everyone()  # every rank's files are in the partial folder
    if accelerator.is_main_process:
        if write_extra is not None:
            write_extra(partial)
        write_manifest(partial)
        install_dir(partial, final)
        if save_total_limit is not None:
            rotate_checkpoints(output_dir, save_total_limit, newest=final)
    accelerator.wait_for_everyone()
    return final


def open_checkpoint(checkpoint_dir: str | os.PathLike) -> dict:
    """Verify a checkpoint against its manifest, then read its run state; what resume and export do first.

    Returns:
        The checkpoint's ``qaccel_state.json`` (:func:`read_run_state`).

    Raises:
        CheckpointError: as :func:`verify_checkpoint` (a missing, truncated, altered or unlisted
            file, named; unsafe DCP metadata).
        FileNotFoundError, ValueError: as :func:`read_run_state`; a folder with neither a manifest
            nor a run state (an export folder, say) is named as not a qaccel checkpoint at all.
    """
    if Path(checkpoint_dir).is_dir() and not (Path(checkpoint_dir) / MANIFEST_FILE).exists():
        run_state_path(checkpoint_dir)  # no run state either: say "not a qaccel checkpoint", not "incomplete"
    verify_checkpoint(checkpoint_dir)
    return read_run_state(checkpoint_dir)
