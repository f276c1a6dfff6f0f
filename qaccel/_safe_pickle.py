"""Check torch DCP ``.metadata`` files before torch unpickles them.

torch's distributed checkpoint reader loads each ``.metadata`` file with plain ``pickle.load``
(``torch/distributed/checkpoint/filesystem.py``), so a crafted file could run code when a
checkpoint is resumed or exported. qaccel first reads every such file with an unpickler that
only resolves the classes DCP metadata is made of; anything else is refused with an error naming
the file and the global it asked for, before torch touches the file.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

__all__ = ["UnsafePickleError", "check_dcp_metadata"]

_ALLOWED_MODULES = {"torch.distributed.checkpoint.metadata"}
_ALLOWED_NAMES = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
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
        allowed = module in _ALLOWED_MODULES or (module, name) in _ALLOWED_NAMES
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise UnsafePickleError(f"{self._path}: refers to {module}.{name}, which DCP metadata never contains; refusing to load it")
        return super().find_class(module, name)


def check_dcp_metadata(root: str | Path) -> int:
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
