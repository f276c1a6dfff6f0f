"""Read the model weights of a training checkpoint, in one process, into a freshly built model.

Accelerate's ``save_state`` writes the model in one of these layouts (``checkpointing.py``
``save_accelerator_state`` and ``utils/fsdp_utils.py`` ``save_fsdp_model``):

- FSDP2 with ``SHARDED_STATE_DICT``: ``pytorch_model_fsdp_0/``, a torch distributed checkpoint
  (DCP) whose keys are the model's ``state_dict()`` keys under a ``model.`` prefix; each rank wrote
  its shards into ``__RANK_0.distcp`` and rank 0 the ``.metadata`` index (offsets and lengths).
- FSDP2 with ``FULL_STATE_DICT``: ``pytorch_model_fsdp.bin`` (``torch.save`` from rank 0).
- DDP or one process: ``model.safetensors`` (``pytorch_model.bin`` without safe serialization),
  from the main process; tied weights (GPT-2's ``lm_head.weight``) are left out of safetensors.

Every file is checked against its own index before anything is read (a DCP shard must reach the
last byte its ``.metadata`` names, a safetensors file must hold the bytes its header lists), so a
truncated file is named instead of surfacing as a deserializer error. The keys must then match the
model's ``state_dict()`` exactly, up to tied aliases of loaded tensors.
"""

from __future__ import annotations

import json
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import check_dcp_metadata, load_torch_file

__all__ = ["WeightSource", "SavedWeights", "find_weights"]

DCP_DIR = "pytorch_model_fsdp_0"
FSDP_FULL_FILE = "pytorch_model_fsdp.bin"
SAFE_FILE = "model.safetensors"
BIN_FILE = "pytorch_model.bin"
_DCP_PREFIX = "model."
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class WeightSource:
    """Where a checkpoint keeps its model weights."""

    kind: str  # "dcp" (FSDP2 sharded), "fsdp_full" (FSDP2 full state dict), "safetensors" or "bin" (DDP)
    path: Path  # the DCP folder or the weights file


def find_weights(checkpoint_dir: Path) -> WeightSource:
    """Locate the model weights Accelerate saved in ``checkpoint_dir``.

    Raises:
        FileNotFoundError: none of the known layouts is present (the message lists them).
        NotImplementedError: per-rank ``torch.save`` shards (FSDP ``use_dcp=False``), which carry no
            index to reassemble them from.
    """
    candidates = (
        ("dcp", checkpoint_dir / DCP_DIR),
        ("fsdp_full", checkpoint_dir / FSDP_FULL_FILE),
        ("safetensors", checkpoint_dir / SAFE_FILE),
        ("bin", checkpoint_dir / BIN_FILE),
    )
    for kind, path in candidates:
        if (kind == "dcp" and path.is_dir()) or (kind != "dcp" and path.is_file()):
            return WeightSource(kind, path)
    per_rank = sorted(checkpoint_dir.glob("pytorch_model_fsdp_0_rank*.bin"))
    if per_rank:
        raise NotImplementedError(
            f"{checkpoint_dir}: per-rank FSDP files ({per_rank[0].name}, ...) were saved without DCP; export reads "
            f"the sharded DCP layout ({DCP_DIR}/) or a full state dict; save with the default use_dcp=True"
        )
    names = ", ".join(f"{path.name}{'/' if kind == 'dcp' else ''}" for kind, path in candidates)
    raise FileNotFoundError(f"{checkpoint_dir}: no model weights found (looked for {names})")


def _check_dcp(folder: Path):
    from torch.distributed.checkpoint import FileSystemReader

    if not (folder / ".metadata").is_file():
        raise ValueError(f"{folder}: no .metadata index; the sharded checkpoint is incomplete")
    check_dcp_metadata(folder)  # torch unpickles .metadata without restrictions: vet it first
    reader = FileSystemReader(str(folder))
    try:
        metadata = reader.read_metadata()
    except Exception as err:  # noqa: BLE001 - a damaged pickle raises anything
        raise ValueError(f"{folder}/.metadata: unreadable ({type(err).__name__}: {err}); the checkpoint is truncated or corrupted") from None
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        shard = folder / name
        if not shard.is_file():
            raise ValueError(f"{shard}: missing; the index ({folder.name}/.metadata) lists it")
        size = shard.stat().st_size
        if size < end:
            raise ValueError(f"{shard}: truncated: {size} bytes, the index ({folder.name}/.metadata) needs at least {end}")
    return reader, metadata


def _check_safetensors(path: Path) -> dict:
    """The file's header, after checking that the file holds every byte the header lists."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: truncated: {size} bytes, not even a safetensors header")
        (header_len,) = struct.unpack("<Q", head)
        raw = fh.read(header_len) if header_len <= size else b""
    if len(raw) < header_len:
        raise ValueError(f"{path}: truncated: {size} bytes, the header alone needs {8 + header_len}")
    try:
        header = json.loads(raw)
        data_end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, IndexError):
        raise ValueError(f"{path}: corrupted safetensors header") from None
    if size < 8 + header_len + data_end:
        raise ValueError(f"{path}: truncated: {size} bytes, its header lists tensors up to byte {8 + header_len + data_end}")
    return header


def _load_state_dict_file(path: Path) -> dict[str, torch.Tensor]:
    state = load_torch_file(path)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path}: expected a state dict of tensors")
    return state


def _most_common_floating(dtypes: list[torch.dtype]) -> torch.dtype | None:
    floating = [d for d in dtypes if d.is_floating_point]
    return max(set(floating), key=floating.count) if floating else None


class SavedWeights:
    """A checkpoint's model weights, checked and indexed but not yet copied into a model."""

    def __init__(self, source: WeightSource) -> None:
        self.source = source
        self._state: dict[str, torch.Tensor] | None = None
        if source.kind == "dcp":
            self._reader, metadata = _check_dcp(source.path)
            entries = {k[len(_DCP_PREFIX):]: meta for k, meta in metadata.state_dict_metadata.items() if k.startswith(_DCP_PREFIX)}
            self.keys = set(entries)
            dtypes = [meta.properties.dtype for meta in entries.values() if hasattr(meta, "properties")]
        elif source.kind == "safetensors":
            header = _check_safetensors(source.path)
            self.keys = {k for k in header if k != "__metadata__"}
            dtypes = [_SAFETENSORS_DTYPES[header[k]["dtype"]] for k in self.keys if header[k]["dtype"] in _SAFETENSORS_DTYPES]
        else:
            self._state = _load_state_dict_file(source.path)
            self.keys = set(self._state)
            dtypes = [t.dtype for t in self._state.values()]
        #: the most common floating dtype of the saved weights: the export keeps it
        self.dtype = _most_common_floating(dtypes)

    def load_into(self, model: torch.nn.Module) -> None:
        """Copy the weights into ``model`` in place.

        Raises:
            ValueError: keys that do not match the model's ``state_dict()`` (tied aliases of saved
                tensors may be absent), a shape mismatch, or an unreadable file; naming the file.
        """
        origin = str(self.source.path)
        _match_keys(model, self.keys, origin)
        if self.source.kind == "dcp":
            import torch.distributed.checkpoint as dcp

            # Read straight into the model's own tensors; tied aliases not in the checkpoint are left out.
            target = {k: v for k, v in model.state_dict().items() if k in self.keys}
            try:
                with warnings.catch_warnings():
                    # "torch.distributed is ... uninitialized, assuming ... a single process": that is the intent.
                    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
                    dcp.load({"model": target}, storage_reader=self._reader, no_dist=True)
            except Exception as err:  # noqa: BLE001 - DCP wraps reader errors in CheckpointException
                raise ValueError(f"{origin}: could not be read ({type(err).__name__}: {err})") from None
            return
        state = self._state
        if state is None:
            from safetensors.torch import load_file

            try:
                state = load_file(origin)
            except Exception as err:  # noqa: BLE001 - SafetensorError and friends
                raise ValueError(f"{origin}: unreadable ({type(err).__name__}: {err})") from None
        try:
            model.load_state_dict(state, strict=False)
        except RuntimeError as err:
            raise ValueError(f"{origin}: {err}") from None


def _match_keys(model: torch.nn.Module, saved_keys: set[str], origin: str) -> None:
    expected = model.state_dict()
    missing = set(expected) - saved_keys
    # A missing key is fine if it is the same tensor as a saved one (tied embeddings).
    saved_storage = {expected[k].untyped_storage().data_ptr() for k in saved_keys if k in expected}
    missing = {k for k in missing if expected[k].untyped_storage().data_ptr() not in saved_storage}
    unexpected = saved_keys - set(expected)
    if missing or unexpected:
        raise ValueError(
            f"{origin}: the saved weights do not match {type(model).__name__} built from the checkpoint's config: "
            f"missing {sorted(missing)[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected {sorted(unexpected)[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
