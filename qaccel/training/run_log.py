"""What a training run measures and shows of each optimizer step: its loss, time and wire bytes, ``metrics.jsonl``, the trackers and the progress bar.

:class:`RunProgress` is where the run stands (what a checkpoint records and the summary reports);
:class:`StepMeter` measures one optimizer step; :class:`StepLog` writes it. The first line a run
prints is :func:`describe_run`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from ..fsdp import bytes_by_level
from .metrics_log import MetricsLog

if TYPE_CHECKING:
    from ..integration import Accelerator
    from .run_settings import RunInputs

__all__ = ["RunProgress", "StepLog", "StepMeter", "StepMeterFactory", "describe_run", "hierarchy_note"]


@dataclass
class RunProgress:
    """Where a run stands: optimizer steps done, the bytes this rank sent in them, the last evaluation."""

    step: int = 0
    wire_bytes_total: int = 0
    last_eval: dict[str, float] | None = None

    @classmethod
    def from_run_state(cls, saved: dict) -> RunProgress:
        """Where the checkpoint whose run state is ``saved`` stopped."""
        return cls(step=saved["step"], wire_bytes_total=saved["wire_bytes_total"], last_eval=saved.get("metrics"))

    def summary(self) -> dict[str, Any]:
        """What the run returns and prints when it is done."""
        return {"step": self.step, "wire_bytes_total": self.wire_bytes_total, **(self.last_eval or {})}


class StepMeter:
    """One optimizer step's loss (mean over its micro-batches and the ranks), wall time, wire bytes and, under a
    1-bit optimizer, its kind (``step_kind``: a :class:`qaccel.optim.StepKind` value such as ``full``,
    ``onebit_gradient`` or ``local``; what the step sends depends on it).

    Creating it closes the wire meter's current step: the bytes of set-up collectives (loading,
    an evaluation at step 0) do not belong to step 1.
    """

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator
        # Built after prepare: a 1-bit optimizer's schedule decides the kind of each step before it, from its state alone.
        optimizers = accelerator.onebit_wiring.optimizers()
        self.schedule = optimizers[0].schedule if optimizers else None
        accelerator.wire_meter.end_step()
        self.restart()

    def restart(self) -> None:
        """Start the next step: no losses yet, its kind, the clock at zero."""
        self.losses: list[torch.Tensor] = []
        self.step_kind = self.schedule.next_kind().value if self.schedule is not None else None
        self.start = time.perf_counter()

    def add(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss (kept on the device: no host sync per micro-batch)."""
        self.losses.append(loss.detach().float())

    def end_step(self, run: RunProgress, *, learning_rate: float) -> dict[str, Any]:
        """Close step ``run.step`` (just completed): its ``metrics.jsonl`` row; adds its bytes to ``run.wire_bytes_total``."""
        step_loss = self.accelerator.reduce(torch.stack(self.losses).mean(), reduction="mean").item()  # host sync, once per step
        step_seconds = time.perf_counter() - self.start
        self.tallies = self.accelerator.wire_meter.end_step()  # by kind: kept for tools that break the bytes down
        levels = bytes_by_level(self.tallies)
        sent = levels["intra_node"] + levels["inter_node"]
        run.wire_bytes_total += sent
        row = {
            "step": run.step,
            "loss": step_loss,
            "learning_rate": learning_rate,
            "wire_bytes": sent,
            "wire_bytes_inter_node": levels["inter_node"],  # hierarchical QSDP's replica all-reduce (0 otherwise)
            "wire_bytes_total": run.wire_bytes_total,
            "step_seconds": step_seconds,
        }
        if self.step_kind is not None:  # only under a 1-bit optimizer: other rows keep their keys
            row["step_kind"] = self.step_kind
        return row

    def end_evaluation(self) -> int:
        """The bytes of the evaluation just run (FSDP2 gathers weights in it), kept out of the next training step."""
        return sum(t.sent_bytes for t in self.accelerator.wire_meter.end_step().values())


StepMeterFactory = Callable[["Accelerator"], StepMeter]
"""What :func:`qaccel.train.train` calls to build its step meter (:class:`StepMeter` itself, or a harness's subclass)."""


class StepLog:
    """``metrics.jsonl`` (main process), the trackers and the progress bar.

    Args:
        output_dir: where ``metrics.jsonl`` goes; a resumed run first drops its lines past ``run.step``.
        run: where the run starts.
        is_resumed: the run continues from a checkpoint.
        logging_steps: write a row every N optimizer steps (and at ``max_steps``).
    """

    def __init__(self, accelerator: Accelerator, output_dir: Path, run: RunProgress, *, is_resumed: bool, logging_steps: int, max_steps: int) -> None:
        self.accelerator = accelerator
        self.logging_steps, self.max_steps = logging_steps, max_steps
        self.metrics = MetricsLog(output_dir / "metrics.jsonl", enabled=accelerator.is_main_process, resume_step=run.step if is_resumed else None)
        self.progress = tqdm(total=max_steps, initial=run.step, disable=not accelerator.is_main_process, desc="train")

    def evaluation(self, step: int, results: dict[str, float]) -> None:
        """An evaluation outside a training step (``--eval_on_start``: step 0)."""
        self.metrics.write({"step": step, **results})
        self.accelerator.log(results, step=step)

    def step(self, row: dict[str, Any]) -> None:
        """A completed optimizer step's row (from :meth:`StepMeter.end_step`, with its evaluation)."""
        step = row["step"]
        if step == self.max_steps or step % self.logging_steps == 0:
            self.metrics.write(row)
            self.accelerator.log({k: v for k, v in row.items() if k != "step"}, step=step)
        self.progress.update(1)
        self.progress.set_postfix(loss=f"{row['loss']:.3f}", sent=f"{row['wire_bytes'] / 1e6:.1f}MB")

    def close(self) -> None:
        self.progress.close()


def hierarchy_note(accelerator: Accelerator) -> str:
    """`` (hierarchical: R replicas x S shards)`` on HSDP (hierarchical QSDP or a sharded 1-bit optimizer), else nothing."""
    handle = accelerator.qsdp  # the QSDPHandle once a model is prepared with a QSDPPlugin
    if handle is not None and handle.replicas > 1:
        return f" (hierarchical: {handle.replicas} replicas x {handle.world_size} shards)"
    for optimizer in accelerator.onebit_wiring.optimizers():
        if optimizer.is_sharded:
            return f" (hierarchical: {optimizer.world_size()} replicas x {optimizer.shard_ranks()} shards, 1-bit across replicas)"
    return ""


def describe_run(accelerator: Accelerator, inputs: RunInputs, model: torch.nn.Module) -> str:
    """The run's first line: recipe, task, method and parallelism, processes, parameters, steps and batch."""
    settings, processes = inputs.settings, accelerator.num_processes
    parameters = sum(p.numel() for p in accelerator.unwrap_model(model).parameters())
    return (
        f"recipe {inputs.recipe.name}: {inputs.recipe.task}, method {inputs.plan.method} on {inputs.plan.parallelism}{hierarchy_note(accelerator)}, "
        f"{processes} processes, {parameters:,} parameters (local), {settings.max_steps} steps of "
        f"{settings.per_device_batch_size} x {settings.gradient_accumulation_steps} x {processes} sequences"
    )
