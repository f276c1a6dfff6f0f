"""QSDP's part of a checkpoint: the seed counters (``qaccel_qsdp.json``) and the error-feedback buffers.

Written and read through Accelerate's state hooks (:func:`qaccel.integration._qsdp.after_prepare`)
and by ``qaccel.Trainer``; JSON and safetensors, so nothing is unpickled on resume.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from ..checkpoint import QSDP_STATE_FILE, atomic_open, atomic_write_json, qsdp_error_rank_path, read_json
from ..fsdp import QSDPHandle

__all__ = ["write_qsdp_state", "read_qsdp_state"]

logger = logging.getLogger(__name__)


def write_qsdp_state(handle: QSDPHandle, output_dir: str | os.PathLike, rank: int, is_main_process: bool) -> None:
    """Write ``qaccel_qsdp.json`` (seed counters, world size, config; main process) and, with gradient
    error feedback, this rank's buffers (``qaccel_qsdp_error_rank<rank>.safetensors``); call on every rank."""
    if is_main_process:
        atomic_write_json(Path(output_dir) / QSDP_STATE_FILE, handle.state_dict())
    if handle.config.grad_error_feedback is not None:
        from safetensors.torch import save

        tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in handle.error_state().items()}
        with atomic_open(qsdp_error_rank_path(output_dir, rank), "wb") as stream:
            stream.write(save(tensors, metadata={"world_size": str(handle.world_size), "rank": str(rank)}))


def read_qsdp_state(handle: QSDPHandle, input_dir: str | os.PathLike, rank: int) -> bool:
    """Restore the seed counters (and this rank's error-feedback buffers) from ``input_dir``.

    Returns False (and a warning) when the folder has no QSDP state.

    Raises:
        ValueError: the checkpoint was saved with other QSDP settings (naming each one), or with
            error feedback on the same world size but without this rank's buffer file.
    """
    path = Path(input_dir) / QSDP_STATE_FILE
    if not path.exists():
        logger.warning(
            "QSDP: %s has no %s (saved without QSDP?): the rounding noise restarts from step 0; training is "
            "unaffected otherwise", input_dir, QSDP_STATE_FILE,
        )  # fmt: skip
        return False
    state = read_json(path)
    handle.load_state_dict(state)
    if handle.config.grad_error_feedback is not None:
        saved_world_size = int(state["world_size"])
        error_path = qsdp_error_rank_path(input_dir, rank)
        tensors: dict[str, torch.Tensor] = {}
        if saved_world_size == handle.world_size:
            if not error_path.exists():
                raise ValueError(
                    f"QSDP checkpoint {input_dir}: saved with grad_error_feedback on {saved_world_size} ranks but "
                    f"{error_path.name} (rank {rank}'s error buffers) is missing; the checkpoint is incomplete"
                )
            from safetensors.torch import load_file

            tensors = load_file(str(error_path))
        handle.load_error_state(tensors, saved_world_size)
    return True
