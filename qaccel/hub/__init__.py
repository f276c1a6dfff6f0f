"""Export training checkpoints to Hugging Face model folders, and upload them to the Hub.

- :mod:`qaccel.hub.export`: a checkpoint -> ``model.safetensors`` (full precision or bitsandbytes
  int8/nf4) with qaccel metadata, ``qaccel_config.json``, config/tokenizer files and a model card.
- :mod:`qaccel.hub.push`: upload an exported folder with ``huggingface_hub`` in one commit.

The checkpoint format they read (``qaccel_state.json``, ``hf_model/``, the manifest) is
:mod:`qaccel.checkpoint`; the resume rules are ``qaccel.training.check_resume``.
Heavy imports (transformers, bitsandbytes) happen inside the functions that need them.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from .export import BNB_CHOICES, SIDECAR_FILE, export_checkpoint, safetensors_metadata
from .push import PushError, plan_push, push_folder

__all__ = [
    "BNB_CHOICES",
    "SIDECAR_FILE",
    "export_checkpoint",
    "safetensors_metadata",
    "PushError",
    "plan_push",
    "push_folder",
]

# Names that lived here before the checkpoint format moved to one module (issue 17): old imports
# keep working and warn once, naming the new home.
_MOVED = {
    "RUN_STATE_FILE": "qaccel.checkpoint",
    "MODEL_FILES_DIR": "qaccel.checkpoint",
    "build_run_state": "qaccel.checkpoint",
    "save_checkpoint_metadata": "qaccel.checkpoint",
    "read_run_state": "qaccel.checkpoint",
    "check_resume": "qaccel.training",
}
_warned: set[str] = set()


def __getattr__(name: str) -> Any:
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module 'qaccel.hub' has no attribute {name!r}")
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"qaccel.hub.{name} moved to {home}.{name}; import it from there", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(home), name)
