"""Checkpoints that record how they were trained; export to Hugging Face model folders; Hub upload.

- :mod:`qaccel.hub.run_state`: ``qaccel_state.json`` and ``hf_model/`` in every training checkpoint,
  and the resume check.
- :mod:`qaccel.hub.export`: a checkpoint -> ``model.safetensors`` (full precision or bitsandbytes
  int8/nf4) with qaccel metadata, ``qaccel_config.json``, config/tokenizer files and a model card.
- :mod:`qaccel.hub.push`: upload an exported folder with ``huggingface_hub`` in one commit.

Heavy imports (transformers, bitsandbytes) happen inside the functions that need them.
"""

from .export import BNB_CHOICES, SIDECAR_FILE, export_checkpoint, safetensors_metadata
from .push import PushError, plan_push, push_folder
from .run_state import (
    MODEL_FILES_DIR,
    RUN_STATE_FILE,
    build_run_state,
    check_resume,
    read_run_state,
    save_checkpoint_metadata,
)

__all__ = [
    "RUN_STATE_FILE",
    "MODEL_FILES_DIR",
    "BNB_CHOICES",
    "SIDECAR_FILE",
    "build_run_state",
    "save_checkpoint_metadata",
    "read_run_state",
    "check_resume",
    "export_checkpoint",
    "safetensors_metadata",
    "PushError",
    "plan_push",
    "push_folder",
]
