"""``ZeroOneAdam``: 0/1 Adam (Lu et al. 2022, arXiv 2202.06009) with DeepSpeed's semantics."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..comm import WireMeter
from ._base import OneBitOptimizerBase
from ._functional import (
    finish_sync,
    local_step,
    local_update,
    sync_payload,
    update_momentum,
)
from ._schedule import Phase, StepKind, ZeroOneAdamSchedule
from ._units import Unit, unit_mask, unit_params_as_weights, unit_weights, write_back
from .config import ZeroOneAdamConfig

__all__ = ["ZeroOneAdam"]


class ZeroOneAdam(OneBitOptimizerBase):
    """0/1 Adam: adaptive variance freezing, 1-bit compressed momentum, local steps (DeepSpeed ``ZeroOneAdam``).

    Step ``t`` (``docs/zero_one_adam.md``, "The algorithm"; :class:`qaccel.optim.StepKind`):

    - ``t = 1``: state is created and the gradient discarded (DeepSpeed's initialization step).
    - ``2 <= t <= F+1``: on variance steps (doubling intervals after ``var_update_scaler`` updates) the
      gradients were all-reduced in full precision by the DDP hook and ``m``, ``v`` update; otherwise the
      local gradient goes through the 1-bit all-reduce and only ``m`` updates. Then
      ``w -= lr (m / (sqrt(v) + eps) + wd w)``.
    - ``t > F+1``: local steps ``m = b1 m + (1-b1) g_local``, ``w -= lr d``, ``u -= lr d``; on sync steps
      (``t`` a multiple of an interval doubling every ``local_step_scaler`` steps up to
      ``local_step_clipper``) ``u (sqrt(v) + eps)`` goes through the 1-bit all-reduce, ``m`` becomes the
      lr-weighted mean momentum and every replica restarts from the same synced weights.
    - ``variance_bias_correction``: every ``sqrt(v)`` above (also in the sync's payload and its inverse) is
      divided by ``sqrt(1 - b2^k)``, ``k`` the variance updates so far (frozen with the variance).

    Where the gradients of a step were all-reduced is decided by :attr:`comm_plan`, which the DDP hook
    reads (:func:`qaccel.optim.register_ddp_comm_hook`; ``qaccel.Accelerator.prepare`` installs it).

    Args:
        params: parameters or param groups; groups may set ``lr``, ``betas``, ``eps``, ``weight_decay``
            and ``exp_avg_mask``.
        config: a :class:`ZeroOneAdamConfig`, used as given (keyword arguments replace its fields). Without
            one, the settings are the keyword arguments (DeepSpeed names, e.g. ``lr``, ``var_freeze_step``,
            ``var_update_scaler``, ``local_step_scaler``, ``local_step_clipper``, ``granularity``), then
            ``QACCEL_ZERO_ONE_ADAM_<FIELD>`` variables, then the recipe, then the defaults.
        recipe: a YAML/JSON file with a ``zero_one_adam`` section, or that section as a mapping (default:
            the file named by ``QACCEL_CONFIG_FILE``, if set; a zoo recipe such as ``model_cards/bert-tiny.md``
            works too). Not together with ``config``.
        process_group: group to average over (default: the default group if torch.distributed is
            initialized, else world size 1, where the 1-bit all-reduce is the identity).
        wire_meter: where the 1-bit all-reduce records its bytes (default: the process-wide meter).

    Memory: fp32 ``m``, ``v``; from phase 2 ``u`` and the synced weights; with world size > 1 the worker
    error (``M'``) and server error (``M'/N``); an fp32 master copy for bf16/fp16 parameters.

    Example::

        optimizer = ZeroOneAdam(model.parameters(), lr=1e-3, var_freeze_step=1000, var_update_scaler=16,
                                local_step_scaler=1000, local_step_clipper=16)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # qaccel.Accelerator
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        config: ZeroOneAdamConfig | None = None,
        *,
        recipe: str | os.PathLike | Mapping[str, Any] | None = None,
        process_group: dist.ProcessGroup | None = None,
        wire_meter: WireMeter | None = None,
        **kwargs: Any,
    ) -> None:
        cfg: ZeroOneAdamConfig = ZeroOneAdamConfig.resolve(config, kwargs, recipe=recipe)
        schedule = ZeroOneAdamSchedule(
            var_freeze_step=cfg.var_freeze_step,
            var_update_scaler=cfg.var_update_scaler,
            local_step_scaler=cfg.local_step_scaler,
            local_step_clipper=cfg.local_step_clipper,
        )
        super().__init__(params, cfg, schedule, process_group=process_group, wire_meter=wire_meter)

    def _ensure_phase_state(self, unit: Unit, state: dict) -> None:
        if self.schedule.phase is Phase.LOCAL_STEPS and "momentum_accumulator" not in state:
            self._start_local_steps(unit, state)

    def _start_local_steps(self, unit: Unit, state: dict) -> None:
        state["momentum_accumulator"] = torch.zeros(unit.shape, dtype=torch.float32, device=unit.anchor.device)
        weights = state["master_weights"] if unit.needs_master else unit_params_as_weights(unit)
        state["synced_weights"] = weights.detach().clone()
        state["lrs"] = 0.0

    def _on_freeze(self, unit: Unit, state: dict) -> None:
        # From here the error buffers track u (sqrt(v) + eps), not gradients: DeepSpeed zeroes them once.
        self._zero_error_buffers(state)
        self._start_local_steps(unit, state)

    def _reset_phase_state(self, unit: Unit, state: dict, weights: torch.Tensor) -> None:
        if self.schedule.phase is Phase.LOCAL_STEPS:
            state["momentum_accumulator"].zero_()
            state["synced_weights"] = weights.detach().clone()
            state["lrs"] = 0.0

    def _step_local(self, units: list[Unit], grads: list[torch.Tensor | None]) -> None:
        """Phase 2 without a sync: ``m``, ``lrs``, then ``w -= lr d`` and ``u -= lr d``; nothing is sent."""
        for unit, grad in zip(units, grads, strict=True):
            if grad is None:
                continue
            group, state = self._group_of(unit), self.state[unit.anchor]
            update_momentum(state["exp_avg"], grad, group["betas"][0])
            state["lrs"] += group["lr"]
            weights = unit_weights(unit, state)
            local_step(
                weights, state["momentum_accumulator"], state["exp_avg"], state["exp_avg_sq"],
                group["lr"], group["eps"], group["weight_decay"], self._variance_correction(StepKind.LOCAL, group),
            )  # fmt: skip
            write_back(unit, weights)

    def _compressed_payload(self, kind: StepKind, unit: Unit, grad: torch.Tensor) -> torch.Tensor:
        """Phase 1: the local gradient. Sync: the local step's ``m``, ``lrs`` and ``u``, then ``u (sqrt(v) + eps)``.

        The sync's local step leaves the weights alone: the sync restarts them from the synced point
        (:func:`finish_sync`), so only its update of ``u`` matters.
        """
        if kind is StepKind.ONEBIT_GRADIENT:
            return grad
        group, state = self._group_of(unit), self.state[unit.anchor]
        update_momentum(state["exp_avg"], grad, group["betas"][0])
        state["lrs"] += group["lr"]
        correction = self._variance_correction(kind, group)
        update = local_update(
            state["exp_avg"], state["exp_avg_sq"], unit_weights(unit, state), group["lr"], group["eps"], group["weight_decay"],
            correction,
        )  # fmt: skip
        state["momentum_accumulator"].add_(update)
        return sync_payload(state["momentum_accumulator"], state["exp_avg_sq"], group["eps"], correction)

    def _apply_averaged(self, kind: StepKind, unit: Unit, averaged: torch.Tensor) -> None:
        group, state = self._group_of(unit), self.state[unit.anchor]
        mask = unit_mask(unit, group)
        if mask is not None:
            averaged.mul_(mask)
        if kind is StepKind.ONEBIT_GRADIENT:
            update_momentum(state["exp_avg"], averaged, group["betas"][0])
            self._descend(unit, state, group, kind)
            return
        weights = unit_weights(unit, state)
        finish_sync(
            weights, state["synced_weights"], state["exp_avg"], state["exp_avg_sq"],
            state["momentum_accumulator"], averaged, state["lrs"], group["eps"], self._variance_correction(kind, group),
        )  # fmt: skip
        state["lrs"] = 0.0
        write_back(unit, weights)
