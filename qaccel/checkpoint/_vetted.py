"""Vetted loading: what qaccel reads back from a checkpoint cannot run code.

- JSON files (run state, manifest, QSDP seed state) are data by construction; :func:`read_json`
  names the file when it does not parse.
- qaccel's own torch files (the 1-bit optimizers' per-rank state) and full-state-dict weights load
  with ``weights_only=True`` (:func:`load_torch_file`): tensors and plain containers only.
- torch's distributed checkpoint reader loads each DCP ``.metadata`` file with plain
  ``pickle.load`` (``torch/distributed/checkpoint/filesystem.py``), so a crafted file could run code
  when a checkpoint is resumed or exported. :func:`check_dcp_metadata` first reads every such file
  with an unpickler that only resolves the classes DCP metadata is made of; anything else is refused
  with an error naming the file and the global it asked for, before torch touches the file.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

from .._torch_internals import dcp_metadata_private_globals

_ALLOWED_MODULES = {"torch.distributed.checkpoint.metadata"}
_ALLOWED_NAMES = {
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class UnsafePickleError(ValueError):
    """A pickled checkpoint file refers to something that is not plain checkpoint metadata."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path) -> None:  # noqa: ANN001
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str):  # noqa: ANN201
        import torch

        allowed = module in _ALLOWED_MODULES or (module, name) in _ALLOWED_NAMES or (module, name) in dcp_metadata_private_globals()
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise UnsafePickleError(f"{self._path}: refers to {module}.{name}, which DCP metadata never contains; refusing to load it")
        return super().find_class(module, name)


def check_dcp_metadata(root: str | os.PathLike) -> int:
    """Read every ``.metadata`` file under ``root`` with the restricted unpickler; return how many.

    Raises:
        UnsafePickleError: a file asks for a global outside DCP's metadata classes, or does not parse.
    """
    count = 0
    for path in sorted(Path(root).rglob(".metadata")):
        with open(path, "rb") as fh:
            try:
                _MetadataUnpickler(fh, path).load()
            except UnsafePickleError:
                raise
            except Exception as err:  # noqa: BLE001 - any parse failure means the file is not what DCP wrote
                raise UnsafePickleError(f"{path}: not a readable DCP metadata file ({type(err).__name__}: {err})") from None
        count += 1
    return count


def load_torch_file(path: str | os.PathLike) -> Any:
    """``torch.load`` onto the CPU with ``weights_only=True``: tensors and plain containers, no code.

    Raises:
        ValueError: the file does not load (truncated, corrupted, or asks for other objects), naming it.
    """
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - a damaged zip/pickle raises anything
        raise ValueError(f"{path}: unreadable ({type(err).__name__}: {err}); the file is truncated or corrupted") from None


def read_json(path: str | os.PathLike) -> Any:
    """Parse a UTF-8 JSON file.

    Raises:
        ValueError: the file is not valid JSON, naming it.
    """
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err}); the file is truncated or corrupted") from None
