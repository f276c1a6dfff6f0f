"""Training checkpoints that appear only complete and are verified before use.

A checkpoint is ``OUTPUT_DIR/checkpoint-STEP/``: Accelerate's ``save_state`` files plus
``qaccel_state.json`` (how the run was trained), ``hf_model/`` (config and tokenizer) and
``manifest.json`` (every file's size and SHA-256). It is written under a hidden partial name,
flushed to disk, and renamed into place by the main process, so a crash mid-write leaves the
previous checkpoint as the latest complete one. Loading checks the manifest first and names the
first missing, truncated or altered file, and refuses torch DCP metadata that refers to
anything but metadata classes (torch unpickles it without restrictions).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._safe_pickle import UnsafePickleError, check_dcp_metadata
from ..hub._fs import fsync_dir, install_dir

__all__ = [
    "CHECKPOINT_PREFIX",
    "MANIFEST_FILE",
    "CheckpointError",
    "checkpoint_path",
    "list_checkpoints",
    "latest_checkpoint",
    "resolve_resume",
    "save_checkpoint",
    "verify_checkpoint",
    "write_manifest",
]

CHECKPOINT_PREFIX = "checkpoint-"
MANIFEST_FILE = "manifest.json"
_PARTIAL_SUFFIX = ".partial"
_NAME = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or altered."""


def checkpoint_path(output_dir: str | os.PathLike, step: int) -> Path:
    return Path(output_dir) / f"{CHECKPOINT_PREFIX}{step}"


def list_checkpoints(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints (those with a manifest) under ``output_dir``, oldest first."""
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
            f"(an interrupted write leaves a hidden '{_PARTIAL_SUFFIX}' folder instead)"
        )
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def write_manifest(root: Path) -> dict[str, Any]:
    """List every file under ``root`` with size and SHA-256, flush them all, write ``manifest.json``."""
    entries = {}
    for path in _files(root):
        _fsync_file(path)
        entries[path.relative_to(root).as_posix()] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    manifest = {"schema_version": 1, "files": entries}
    tmp = root / (MANIFEST_FILE + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, root / MANIFEST_FILE)
    for directory in {p.parent for p in _files(root)} | {root}:
        fsync_dir(directory)
    return manifest


def verify_checkpoint(root: str | os.PathLike) -> int:
    """Check every file against the manifest; return the bytes read.

    Raises:
        CheckpointError: naming the first missing, truncated or altered file, or an unlisted one.
    """
    root = Path(root)
    manifest_path = root / MANIFEST_FILE
    if not manifest_path.is_file():
        raise CheckpointError(f"{root}: no {MANIFEST_FILE}; not a complete qaccel checkpoint")
    try:
        listed = json.loads(manifest_path.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({err})") from None
    read = 0
    for rel, entry in sorted(listed.items()):
        path = root / rel
        if not path.is_file():
            raise CheckpointError(f"{root}: file {rel} is listed in the manifest but missing")
        size = path.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(f"{root}: file {rel} has {size} bytes, the manifest says {entry['size']} (truncated or replaced)")
        if _sha256(path) != entry["sha256"]:
            raise CheckpointError(f"{root}: file {rel} does not match its SHA-256 in the manifest (altered or corrupted)")
        read += size
    extra = sorted(p.relative_to(root).as_posix() for p in _files(root) if p.relative_to(root).as_posix() not in listed)
    if extra:
        raise CheckpointError(f"{root}: files not in the manifest: {', '.join(extra)}")
    try:  # torch reads DCP metadata with plain pickle: only metadata classes may be in it
        check_dcp_metadata(root)
    except UnsafePickleError as err:
        raise CheckpointError(str(err)) from None
    return read


def save_checkpoint(accelerator: Any, output_dir: str | os.PathLike, step: int, write_extra: Callable[[Path], None] | None = None) -> Path:
    """Save the full training state as ``checkpoint-STEP`` atomically; every rank must call it.

    Args:
        accelerator: the run's Accelerator (its ``save_state`` writes the model, optimizer,
            scheduler, RNG and registered state; qaccel's hooks add per-rank optimizer files).
        write_extra: called on the main process with the partial folder before the manifest is
            written (qaccel_state.json, hf_model/).
    """
    final = checkpoint_path(output_dir, step)
    partial = final.with_name("." + final.name + _PARTIAL_SUFFIX)
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)  # left by a crash during an earlier save
        partial.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if write_extra is not None:
            write_extra(partial)
        write_manifest(partial)
        install_dir(partial, final)  # replaces a same-step checkpoint (a resumed run) whole
    accelerator.wait_for_everyone()
    return final
