"""qaccel's own state in Trainer checkpoints (``checkpoint-<step>/``).

The Trainer does not go through ``accelerator.save_state`` / ``load_state``: it writes the model, the
optimizer (``optimizer.pt`` from the main process under DDP, DCP folders under FSDP), the scheduler and
the RNG states itself. What ``qaccel.Accelerator`` would have added to ``save_state`` is added here:

- QSDP: ``qaccel_qsdp.json`` (main process): the seed schedule's step, seed, world size and config,
  so a resumed run draws the same rounding noise as an uninterrupted one.
- 0/1 Adam / 1-bit Adam: ``qaccel_zoadam_rank{r}.pt`` (every rank): that rank's error buffers, momentum
  accumulator and, between 0/1 Adam syncs, its local weights; written and staged by the accelerator's
  ``onebit_wiring``, as ``save_state`` / ``load_state`` do, so the files and their checks are identical.

The file names and the atomic writer are ``qaccel.checkpoint``'s; ``TrainingArguments.save_total_limit``
rotates these folders through transformers' own rotation, after the new checkpoint is written.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ._qsdp import read_qsdp_state, write_qsdp_state

__all__ = ["save_qaccel_state", "stage_onebit_state", "load_qsdp_state"]

logger = logging.getLogger(__name__)


def save_qaccel_state(accelerator: Any, output_dir: str | os.PathLike) -> None:
    """Write qaccel's state next to the Trainer's; call on every rank."""
    # Under DDP only the main process creates the folder (when saving the model): do not race it.
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    handle = getattr(accelerator, "qsdp", None)
    if handle is not None:
        write_qsdp_state(handle, output_dir, accelerator.process_index, accelerator.is_main_process)
    accelerator.onebit_wiring.save_rank_state(str(output_dir))


def stage_onebit_state(accelerator: Any, checkpoint: str | os.PathLike) -> None:
    """Stage this rank's 1-bit optimizer file so the next ``optimizer.load_state_dict`` restores it."""
    accelerator.onebit_wiring.stage_rank_state(str(checkpoint))


def load_qsdp_state(accelerator: Any, checkpoint: str | os.PathLike) -> None:
    """Restore the QSDP seed schedule from ``checkpoint`` (a warning when the file is missing)."""
    handle = getattr(accelerator, "qsdp", None)
    if handle is None:
        return
    read_qsdp_state(handle, checkpoint, accelerator.process_index)
