"""File and folder names of a qaccel checkpoint, and finding the complete checkpoints of a run."""

from __future__ import annotations

import os
import re
from pathlib import Path

CHECKPOINT_PREFIX = "checkpoint-"
#: every other file's size and SHA-256; written last, so its presence marks a complete checkpoint
MANIFEST_FILE = "manifest.json"
#: how the run was trained (``build_run_state``)
RUN_STATE_FILE = "qaccel_state.json"
#: ``config.json``, ``generation_config.json`` and tokenizer files
MODEL_FILES_DIR = "hf_model"
#: QSDP's seed schedule (main process), JSON
QSDP_STATE_FILE = "qaccel_qsdp.json"
#: QSDP's gradient error-feedback buffers of one rank (every rank, with grad_error_feedback), safetensors
QSDP_ERROR_RANK_FILE = "qaccel_qsdp_error_rank{rank}.safetensors"
STREAM_STATE_FILE = "qaccel_stream_state.json"  # a --streaming run: [rank 0's stream position, rank 1's, ...]
#: a 1-bit optimizer's per-rank state (every rank), ``torch.save`` of tensors and plain values
ONEBIT_RANK_FILE = "qaccel_zoadam_rank{rank}.pt"
#: DiLoCo's per-rank state (every rank): its outer state and the island's inner optimizer state, ``torch.save``
DILOCO_RANK_FILE = "qaccel_diloco_rank{rank}.pt"
PARTIAL_SUFFIX = ".partial"
_NAME = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or altered."""


def checkpoint_path(output_dir: str | os.PathLike, step: int) -> Path:
    """``OUTPUT_DIR/checkpoint-STEP``."""
    return Path(output_dir) / f"{CHECKPOINT_PREFIX}{step}"


def partial_path(output_dir: str | os.PathLike, step: int) -> Path:
    """The hidden folder ``checkpoint-STEP`` is written in before it is renamed into place.

    The name is the same on every rank (they all write into it) and never matches a complete
    checkpoint's, so listing, resuming and rotation never see it.
    """
    final = checkpoint_path(output_dir, step)
    return final.with_name("." + final.name + PARTIAL_SUFFIX)


def onebit_rank_path(folder: str | os.PathLike, rank: int) -> Path:
    """Where rank ``rank`` keeps its 1-bit optimizer state in a checkpoint folder."""
    return Path(folder) / ONEBIT_RANK_FILE.format(rank=rank)


def diloco_rank_path(folder: str | os.PathLike, rank: int) -> Path:
    """Where rank ``rank`` keeps its DiLoCo state in a checkpoint folder."""
    return Path(folder) / DILOCO_RANK_FILE.format(rank=rank)


def qsdp_error_rank_path(folder: str | os.PathLike, rank: int) -> Path:
    """Where rank ``rank`` keeps its QSDP gradient error-feedback buffers in a checkpoint folder."""
    return Path(folder) / QSDP_ERROR_RANK_FILE.format(rank=rank)


def list_checkpoints(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints (``checkpoint-STEP`` folders with a manifest) under ``output_dir``, oldest step first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _NAME.match(child.name)
        if match and child.is_dir() and (child / MANIFEST_FILE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step, or ``None``."""
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def resolve_resume(value: str | None, output_dir: str | os.PathLike) -> Path | None:
    """``--resume_from_checkpoint``: ``None``, ``"latest"`` (``None`` when there is none yet) or a path.

    Raises:
        CheckpointError: a path that is not a complete checkpoint.
    """
    if value is None:
        return None
    if value == "latest":
        return latest_checkpoint(output_dir)
    path = Path(value)
    if not path.is_dir():
        raise CheckpointError(f"--resume_from_checkpoint {value}: no such directory")
    if not (path / MANIFEST_FILE).is_file():
        raise CheckpointError(
            f"--resume_from_checkpoint {value}: no {MANIFEST_FILE}; not a complete qaccel checkpoint "
            f"(an interrupted write leaves a hidden '{PARTIAL_SUFFIX}' folder instead)"
        )
    return path
