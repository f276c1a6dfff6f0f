"""Crash-safe file and folder writes: a reader sees the old content or the new, never half of either."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["fsync_dir", "fsync_tree", "write_text_atomic", "install_dir", "staging_dir"]


def fsync_dir(path: Path) -> None:
    """Flush a directory entry (a rename inside it) to disk; a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file under ``root`` and every directory entry, so a following rename publishes whole files."""
    for directory, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(directory, name), "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(Path(directory))


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary sibling, flush it, and rename it over ``path``."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def staging_dir(target: Path, purpose: str) -> Path:
    """A fresh hidden sibling of ``target`` to build into (same file system, so the final rename is atomic)."""
    tmp = target.parent / f".{target.name}.{purpose}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed earlier attempt of this process id
    tmp.mkdir(parents=True)
    return tmp


def install_dir(staged: Path, target: Path) -> None:
    """Move the finished folder ``staged`` to ``target``, replacing an existing ``target`` whole.

    The old folder is first renamed aside, so at every moment ``target`` is either the complete old
    folder, absent for the instant between two renames, or the complete new one.
    """
    fsync_tree(staged)
    if target.exists() or target.is_symlink():
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
        os.replace(staged, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staged, target)
    fsync_dir(target.parent)
