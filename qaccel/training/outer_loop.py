"""The loop around the optimizer's steps: DiLoCo's outer loop for ``--method diloco``, nothing for the other methods.

The training loop holds one :class:`OuterLoop` for the whole run (``with outer_loop(...) as outer``)
and calls ``outer.step(last=...)`` once per optimizer step. Under DiLoCo that counts the step and,
every ``sync_every`` steps and at the run's last step, averages the islands' pseudo-gradients
(:class:`qaccel.optim.DiLoCo`). A checkpoint then holds one model, since the islands are identical
right after a sync, and each rank's ``qaccel_diloco_rank{r}.pt`` the state that differs between
islands: the inner optimizer's, and DiLoCo's own (error feedback, and under HSDP the rank's shards
of the global weights). Checkpoints, evaluations and replica checks therefore fall on sync steps
(:func:`check_outer_schedule`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..checkpoint import atomic_torch_save, diloco_rank_path, load_torch_file
from ..optim import DiLoCo
from .guards import ENV_CHECK_REPLICAS
from .methods import MethodPlan
from .run_settings import TrainingSettings

__all__ = ["OuterLoop", "DiLoCoLoop", "outer_loop", "check_outer_schedule"]


class OuterLoop:
    """No outer loop: every method but DiLoCo."""

    def __enter__(self) -> OuterLoop:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        return None

    def step(self, *, last: bool) -> None:
        """One optimizer step is complete (``last``: the run's final one)."""

    def resume(self, folder: Path | None) -> None:
        """Restore this rank's part of the checkpoint ``folder`` (None: a fresh run), after Accelerate loaded its own."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer wraps the torch one


def local_optimizer_state(optimizer: Any) -> list[dict[str, torch.Tensor]]:
    """The optimizer's tensor state per parameter (param-group order), this rank's local values of sharded ones."""
    inner = _inner_optimizer(optimizer)
    params = [p for group in inner.param_groups for p in group["params"]]
    return [{key: _local(value).detach().clone() for key, value in inner.state.get(p, {}).items() if torch.is_tensor(value)} for p in params]


def load_local_optimizer_state(optimizer: Any, saved: list[dict[str, torch.Tensor]], where: Path) -> None:
    """Write :func:`local_optimizer_state`'s values back into the optimizer's (already loaded) state, in place."""
    inner = _inner_optimizer(optimizer)
    params = [p for group in inner.param_groups for p in group["params"]]
    if len(saved) != len(params):
        raise ValueError(f"{where}: inner optimizer state for {len(saved)} parameters, the optimizer has {len(params)}")
    for index, (param, values) in enumerate(zip(params, saved, strict=True)):
        state = inner.state.get(param, {})
        for key, value in values.items():
            if key not in state:
                raise ValueError(f"{where}: parameter {index} has no optimizer state {key!r} after loading the checkpoint")
            target = _local(state[key])
            if target.shape != value.shape:
                raise ValueError(f"{where}: parameter {index} state {key!r} has shape {tuple(value.shape)}, expected {tuple(target.shape)}")
            target.copy_(value)


class DiLoCoLoop(OuterLoop):
    """DiLoCo around the run's loop; saves and restores each rank's part of a checkpoint.

    Args:
        accelerator: the run's ``qaccel.Accelerator`` (its wire meter records the outer collectives).
        model: the prepared model (DDP, or HSDP shards under hierarchical QSDP).
        optimizer: the prepared inner optimizer.
        plan: the run's method plan (``plan.diloco``).
    """

    def __init__(self, accelerator: Any, model: torch.nn.Module, optimizer: Any, plan: MethodPlan) -> None:
        self.accelerator, self.optimizer = accelerator, optimizer
        # DiLoCo's keywords are DiLoCoConfig's fields: every setting passes, a new one included
        settings = {f.name: getattr(plan.diloco, f.name) for f in dataclasses.fields(plan.diloco)}
        self.diloco = DiLoCo(accelerator, model, **settings, meter=accelerator.wire_meter)
        accelerator.register_save_state_pre_hook(self._save_rank_state)

    def __enter__(self) -> DiLoCoLoop:
        self.diloco.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.diloco.__exit__(exc_type, exc, tb)

    def step(self, *, last: bool) -> None:
        self.diloco.step()
        if last:
            self.diloco.sync_pending()  # the run ends on one model: checkpoint, evaluation and export see it

    def _save_rank_state(self, models: list, weights: list, output_dir: str) -> None:
        payload = {
            "rank": self.accelerator.process_index,
            "world_size": self.accelerator.num_processes,
            "diloco": self.diloco.state_dict(),
            "inner_optimizer": local_optimizer_state(self.optimizer),
        }
        atomic_torch_save(payload, diloco_rank_path(output_dir, self.accelerator.process_index))

    def resume(self, folder: Path | None) -> None:
        if folder is None:
            return
        rank = self.accelerator.process_index
        path = diloco_rank_path(folder, rank)
        payload = load_torch_file(path)
        if payload.get("rank") != rank or payload.get("world_size") != self.accelerator.num_processes:
            raise ValueError(
                f"{path}: holds rank {payload.get('rank')} of {payload.get('world_size')}, expected rank {rank} of "
                f"{self.accelerator.num_processes}"
            )
        try:
            self.diloco.load_state_dict(payload["diloco"])
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None
        load_local_optimizer_state(self.optimizer, payload["inner_optimizer"], path)


def outer_loop(accelerator: Any, model: torch.nn.Module, optimizer: Any, plan: MethodPlan) -> OuterLoop:
    """The run's outer loop: :class:`DiLoCoLoop` for ``--method diloco``, else one that does nothing."""
    return DiLoCoLoop(accelerator, model, optimizer, plan) if plan.diloco is not None else OuterLoop()


def check_outer_schedule(plan: MethodPlan, settings: TrainingSettings, replica_interval: int) -> None:
    """Refuse checkpoints, evaluations and replica checks between DiLoCo's syncs, before anything starts.

    Between syncs every island holds its own model: a checkpoint holds one, an evaluation and a replica
    check compare one. Each therefore falls on a multiple of ``sync_every`` (0 for checkpoints and
    evaluations: only at the end, where the run syncs); with fragments, where some fragment always
    differs between islands, only at the end.

    Raises:
        ValueError: naming the setting, its value and the period.
    """
    if plan.diloco is None:
        return
    period, fragments = plan.diloco.sync_every, plan.diloco.fragments
    for name, value in (("--save_steps", settings.save_steps), ("--eval_steps", settings.eval_steps), (ENV_CHECK_REPLICAS, replica_interval)):
        if value and fragments > 1:
            raise ValueError(
                f"{name}={value} with --diloco_fragments={fragments}: must be 0 (only at the end, where the run syncs every "
                "fragment); with fragments some part of the model always differs between islands"
            )
        if value and value % period:
            raise ValueError(
                f"{name}={value} with --method diloco: must be a multiple of --diloco_sync_every={period}, or 0 (only at "
                "the end, where the run syncs); between syncs every island holds its own model"
            )
