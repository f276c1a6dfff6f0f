"""The one crash-safe writer: a reader sees a file or folder whole (old or new), never half of either.

Every file qaccel writes for a later reader (checkpoint pieces, the manifest, export folders, the
zoo's corpus and tokenizer caches) goes through :func:`atomic_open` or :func:`install_dir`. Both
build under a hidden sibling name on the same file system, flush it to disk, and rename it into
place (``rename(2)`` is atomic within one file system); a failure removes the sibling. Temporary
names carry the process id and a random token, so several processes (ranks) writing the same path
never collide: the last rename wins, or with ``install_dir(replace=False)`` the first.

A published file gets the mode the user's umask gives any new file (``0o666 & ~umask``, 0644 under
the usual 022), whoever wrote it into the staged folder: safetensors >= 0.8 writes through a
temporary file of mode 0600 (safetensors/safetensors#782), which would leave ``model.safetensors``
readable by its owner only while ``config.json`` next to it is readable by all.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

_MODES = ("w", "wb")


def _umask_by_setting() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# os.umask can only be read by setting it, and the mask is process-wide: a thread creating a file
# between the two calls would get the wrong mode. So it is set-and-restored once, here, at import
# (before a training run starts threads), as the fallback for systems without /proc.
_IMPORT_UMASK = _umask_by_setting()


def current_umask() -> int:
    """The process's file mode creation mask, read without changing it.

    Linux (>= 4.7) publishes it as ``Umask:`` in ``/proc/self/status``; elsewhere the mask read at
    import is returned (setting it to read it would race with other threads).
    """
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return _IMPORT_UMASK


def new_file_mode() -> int:
    """The mode a plain ``open(path, "w")`` gives a new file under the current umask (``0o666 & ~umask``)."""
    return 0o666 & ~current_umask()


def publish_modes(root: str | os.PathLike) -> None:
    """Give every regular file under ``root`` (or ``root`` itself, a file) the mode of a new file.

    Writers that create files through a private temporary file (safetensors >= 0.8: mode 0600)
    would otherwise publish files other users cannot read; symbolic links are left alone.
    """
    mode = new_file_mode()
    root = Path(root)
    paths = [root] if root.is_file() else [Path(d) / name for d, _, names in os.walk(root) for name in names]
    for path in paths:
        if not path.is_symlink() and path.is_file():
            os.chmod(path, mode)


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


def _hidden_sibling(target: Path, purpose: str) -> Path:
    # pid + random token: unique across ranks and across threads of one process.
    return target.parent / f".{target.name}.{purpose}-{os.getpid()}-{secrets.token_hex(4)}"


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w") -> Iterator[IO[Any]]:
    """A handle to a hidden temporary sibling of ``path``, renamed onto ``path`` when the block ends.

    The file is flushed (``fsync``) before the rename, and the folder entry after it. If the block
    raises, the temporary file is removed and ``path`` keeps whatever it held before.

    Args:
        path: the file to write; missing parent folders are created.
        mode: ``"w"`` (UTF-8 text) or ``"wb"`` (bytes).

    Raises:
        ValueError: another ``mode``.

    Example::

        with atomic_open(folder / "state.pt", "wb") as handle:
            torch.save(state, handle)
    """
    if mode not in _MODES:
        raise ValueError(f"atomic_open mode={mode!r}: must be one of {list(_MODES)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _hidden_sibling(path, "tmp")
    try:
        # "x": the name is fresh; never write into a file another process opened.
        with open(tmp, mode.replace("w", "x"), **({"encoding": "utf-8"} if mode == "w" else {})) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (see :func:`atomic_open`)."""
    with atomic_open(path) as handle:
        handle.write(text)


def atomic_write_json(path: str | os.PathLike, value: Any) -> None:
    """Write ``value`` as indented, key-sorted JSON to ``path`` atomically (see :func:`atomic_open`)."""
    atomic_write_text(path, json.dumps(value, indent=2, sort_keys=True) + "\n")


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj)`` to ``path`` atomically (see :func:`atomic_open`); read it back with ``load_torch_file``."""
    import torch

    with atomic_open(path, "wb") as handle:
        torch.save(obj, handle)


def staging_dir(target: str | os.PathLike, purpose: str) -> Path:
    """Create a fresh hidden sibling folder of ``target`` to build into before :func:`install_dir`.

    A sibling, so the final rename stays on one file system; ``purpose`` appears in its name so a
    leftover of a killed process says what it was.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = _hidden_sibling(target, purpose)
    staged.mkdir()
    return staged


def install_dir(staged: str | os.PathLike, target: str | os.PathLike, *, replace: bool = True) -> bool:
    """Flush the finished folder ``staged`` and rename it to ``target``.

    Every file in it first gets the mode the umask gives a new file (:func:`publish_modes`).

    Args:
        staged: a folder built in full (usually from :func:`staging_dir`).
        target: where it goes.
        replace: an existing ``target`` is replaced whole: it is renamed aside first, so at every
            moment ``target`` is the complete old folder, absent for the instant between two
            renames, or the complete new one. With ``replace=False`` an existing non-empty
            ``target`` wins (a cache another process filled first): ``staged`` is deleted.

    Returns:
        True if ``staged`` became ``target``; False if ``replace=False`` kept an existing one.
    """
    staged, target = Path(staged), Path(target)
    publish_modes(staged)
    fsync_tree(staged)
    if replace and (target.exists() or target.is_symlink()):
        old = _hidden_sibling(target, "old")
        os.replace(target, old)
        os.replace(staged, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        try:
            os.replace(staged, target)  # fails on a non-empty folder: another writer was first
        except OSError:
            if replace or not target.exists():
                raise
            shutil.rmtree(staged, ignore_errors=True)
            return False
    fsync_dir(target.parent)
    return True


def remove_dir(path: str | os.PathLike) -> None:
    """Delete a folder without ever showing it half-deleted under its own name: rename it aside first."""
    path = Path(path)
    aside = _hidden_sibling(path, "deleting")
    os.replace(path, aside)
    fsync_dir(path.parent)
    shutil.rmtree(aside, ignore_errors=True)
