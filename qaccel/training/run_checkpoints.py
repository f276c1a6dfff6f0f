"""A training run's checkpoints: resuming from one, saving them, pushing the last one to the Hub.

The format (atomic folders, the manifest, rotation) is :mod:`qaccel.checkpoint`; this module
decides what a run puts in it: Accelerate's state, the run state (:meth:`RunInputs.run_state`), the
model's config, the tokenizer, and the train loader's position.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..checkpoint import checkpoint_path, save_checkpoint, save_checkpoint_metadata
from .run_log import RunProgress

if TYPE_CHECKING:
    from ..integration import Accelerator
    from .loaders import TrainLoader
    from .outer_loop import OuterLoop
    from .run_settings import RunInputs

__all__ = ["RunCheckpointer", "push_final_checkpoint", "resume_run"]


def resume_run(accelerator: Accelerator, inputs: RunInputs, train_data: TrainLoader, outer: OuterLoop | None = None) -> RunProgress:
    """Load the checkpoint to resume from, if any (model, optimizer, scheduler, RNG, the train loader's position).

    ``outer`` (DiLoCo's) then restores this rank's own part of the checkpoint.

    Returns:
        Where the run continues: the checkpoint's step, bytes and last evaluation, or step 0.
    """
    if inputs.saved is None or inputs.resume_from is None:
        return RunProgress()
    for warning in inputs.resume_warnings:
        accelerator.print(f"resume: {warning}")
    accelerator.load_state(str(inputs.resume_from))
    if outer is not None:
        outer.resume(inputs.resume_from)
    run = RunProgress.from_run_state(inputs.saved)
    train_data.resume(inputs.resume_from, run.step * inputs.settings.gradient_accumulation_steps)
    accelerator.print(f"resumed from {inputs.resume_from} at step {run.step}")
    return run


class RunCheckpointer:
    """Saves ``checkpoint-STEP`` every ``save_steps`` optimizer steps and at the last one.

    Args:
        model: the prepared model (its unwrapped config and generation config are saved with it).
        tokenizer: saved into the checkpoint's ``hf_model/``.
        save_total_limit: keep only the N newest complete checkpoints (None: all).
    """

    def __init__(self, accelerator: Accelerator, inputs: RunInputs, train_data: TrainLoader, model: torch.nn.Module, tokenizer: Any, *, save_total_limit: int | None) -> None:
        self.accelerator, self.inputs, self.train_data, self.tokenizer = accelerator, inputs, train_data, tokenizer
        self.model = accelerator.unwrap_model(model)
        self.save_total_limit = save_total_limit

    def is_due(self, step: int) -> bool:
        """Optimizer step ``step`` ends with a checkpoint."""
        settings = self.inputs.settings
        return step == settings.max_steps or bool(settings.save_steps and step % settings.save_steps == 0)

    def save(self, run: RunProgress) -> Path:
        """Every rank: save the run as it stands after ``run.step``; returns the checkpoint folder."""
        write_position = self.train_data.checkpoint_writer()  # collective: the loader's position, to the main process

        def write_extra(folder: Path) -> None:
            write_position(folder)
            save_checkpoint_metadata(
                folder,
                run_state=self.inputs.run_state(run.step, run.wire_bytes_total, run.last_eval),
                model_config=self.model.config,
                tokenizer=self.tokenizer,
                generation_config=getattr(self.model, "generation_config", None),  # a model that generates has one
            )

        path = save_checkpoint(self.accelerator, self.inputs.output_dir, run.step, write_extra, save_total_limit=self.save_total_limit)
        self.accelerator.print(f"saved {path}")
        return path


def push_final_checkpoint(accelerator: Accelerator, output_dir: Path, step: int, hub_model_id: str) -> None:
    """Export ``checkpoint-STEP`` (a Hub-ready folder in ``output_dir/export``) and push it to ``hub_model_id`` (main process)."""
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return
    from ..hub.export import export_checkpoint  # huggingface_hub and the card: only when pushing
    from ..hub.push import push_folder

    exported = export_checkpoint(checkpoint_path(output_dir, step), output_dir / "export", overwrite=True, model_name=hub_model_id)
    push_folder(exported, hub_model_id)
