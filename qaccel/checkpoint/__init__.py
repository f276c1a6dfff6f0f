"""The qaccel checkpoint format, in one place: layout, manifest, run state, atomic writes, vetted loading.

A training run writes ``OUTPUT_DIR/checkpoint-STEP/`` with :func:`save_checkpoint`::

    checkpoint-STEP/
        manifest.json              every other file's size and SHA-256 (written last: marks it complete)
        qaccel_state.json          how the run was trained (build_run_state / save_checkpoint_metadata)
        hf_model/                  config.json, generation_config.json, tokenizer files
        qaccel_qsdp.json           QSDP seed schedule (QSDP runs, main process)
        qaccel_zoadam_rank{r}.pt   a 1-bit optimizer's per-rank state (0/1 Adam, 1-bit Adam; every rank)
        ...                        what accelerator.save_state writes (model.safetensors or
                                   pytorch_model_fsdp_0/, optimizer, scheduler, RNG states)
    .checkpoint-STEP.partial/      the same while it is being written; never listed or resumed

Resume and ``qaccel export`` open a checkpoint with :func:`open_checkpoint`: every file is checked
against the manifest (the first missing, truncated, altered or unlisted file is named) and DCP
metadata pickles are vetted before anything is read. :func:`rotate_checkpoints` keeps the newest N.
``qaccel.Trainer`` checkpoints use transformers' layout plus the QSDP and per-rank files above.

Every file qaccel writes for a later reader, here and in the zoo's caches, goes through the one
atomic writer (:func:`atomic_open`, :func:`install_dir`). Nothing here imports torch, Accelerate or
transformers at import time, and nothing from qaccel's higher layers.
"""

from ._atomic import (
    atomic_open,
    atomic_torch_save,
    atomic_write_json,
    atomic_write_text,
    current_umask,
    fsync_dir,
    fsync_tree,
    install_dir,
    new_file_mode,
    publish_modes,
    remove_dir,
    staging_dir,
)
from ._checkpoint import (
    check_save_total_limit,
    open_checkpoint,
    remove_partial_checkpoints,
    rotate_checkpoints,
    save_checkpoint,
)
from ._layout import (
    CHECKPOINT_PREFIX,
    DILOCO_RANK_FILE,
    MANIFEST_FILE,
    MODEL_FILES_DIR,
    ONEBIT_RANK_FILE,
    QSDP_ERROR_RANK_FILE,
    QSDP_STATE_FILE,
    RUN_STATE_FILE,
    STREAM_STATE_FILE,
    CheckpointError,
    checkpoint_path,
    diloco_rank_path,
    latest_checkpoint,
    list_checkpoints,
    onebit_rank_path,
    partial_path,
    qsdp_error_rank_path,
    resolve_resume,
)
from ._manifest import file_sha256, verify_checkpoint, write_manifest
from ._run_state import (
    METHODS,
    SCHEMA_VERSION,
    TASKS,
    build_run_state,
    check_run_state,
    read_run_state,
    save_checkpoint_metadata,
)
from ._vetted import UnsafePickleError, check_dcp_metadata, load_torch_file, read_json

__all__ = [
    # layout
    "CHECKPOINT_PREFIX",
    "MANIFEST_FILE",
    "RUN_STATE_FILE",
    "MODEL_FILES_DIR",
    "QSDP_STATE_FILE",
    "STREAM_STATE_FILE",
    "DILOCO_RANK_FILE",
    "ONEBIT_RANK_FILE",
    "QSDP_ERROR_RANK_FILE",
    "CheckpointError",
    "checkpoint_path",
    "partial_path",
    "diloco_rank_path",
    "onebit_rank_path",
    "qsdp_error_rank_path",
    "list_checkpoints",
    "latest_checkpoint",
    "resolve_resume",
    # whole checkpoints
    "save_checkpoint",
    "open_checkpoint",
    "rotate_checkpoints",
    "remove_partial_checkpoints",
    "check_save_total_limit",
    # manifest
    "file_sha256",
    "write_manifest",
    "verify_checkpoint",
    # run state
    "SCHEMA_VERSION",
    "METHODS",
    "TASKS",
    "build_run_state",
    "save_checkpoint_metadata",
    "read_run_state",
    "check_run_state",
    # atomic writes
    "atomic_open",
    "atomic_write_text",
    "atomic_write_json",
    "atomic_torch_save",
    "staging_dir",
    "install_dir",
    "remove_dir",
    "fsync_dir",
    "fsync_tree",
    "current_umask",
    "new_file_mode",
    "publish_modes",
    # vetted loading
    "UnsafePickleError",
    "check_dcp_metadata",
    "load_torch_file",
    "read_json",
]
