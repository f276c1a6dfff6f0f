"""``manifest.json``: every file of a checkpoint with its size and SHA-256, and the check against it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from ._atomic import atomic_write_json
from ._layout import MANIFEST_FILE, CheckpointError
from ._vetted import UnsafePickleError, check_dcp_metadata, read_json

MANIFEST_SCHEMA_VERSION = 1


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def write_manifest(root: str | os.PathLike) -> dict[str, Any]:
    """List every file under ``root`` with its size and SHA-256 in ``root/manifest.json``; return the manifest.

    Call it once everything else is written: the folder counts as complete from then on.
    """
    root = Path(root)
    entries = {path.relative_to(root).as_posix(): {"size": path.stat().st_size, "sha256": file_sha256(path)} for path in _files(root)}
    manifest = {"schema_version": MANIFEST_SCHEMA_VERSION, "files": entries}
    atomic_write_json(root / MANIFEST_FILE, manifest)
    return manifest


def verify_checkpoint(root: str | os.PathLike) -> int:
    """Check every file against the manifest and vet the DCP metadata pickles; return the bytes read.

    Resume and ``qaccel export`` both call it before they read anything else.

    Raises:
        CheckpointError: no folder or no manifest; naming the first missing, truncated or altered
            file, or an unlisted one; DCP metadata that refers to anything but metadata classes.
    """
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint folder")
    manifest_path = root / MANIFEST_FILE
    if not manifest_path.is_file():
        raise CheckpointError(f"{root}: no {MANIFEST_FILE}; not a complete qaccel checkpoint")
    try:
        listed = read_json(manifest_path)["files"]
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({err})") from None
    read = 0
    for rel, entry in sorted(listed.items()):
        path = root / rel
        if not path.is_file():
            raise CheckpointError(f"{root}: file {rel} is listed in the manifest but missing")
        size = path.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(f"{root}: file {rel} has {size} bytes, the manifest says {entry['size']} (truncated or replaced)")
        if file_sha256(path) != entry["sha256"]:
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
