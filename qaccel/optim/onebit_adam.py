"""``OneBitAdam``: 1-bit Adam (Tang et al. 2021, arXiv 2102.02888) with DeepSpeed's semantics."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..comm import WireMeter
from ._base import OneBitOptimizerBase
from ._functional import update_momentum
from ._schedule import OneBitAdamSchedule, StepKind
from ._units import Unit, unit_mask
from .config import OneBitAdamConfig

__all__ = ["OneBitAdam"]


class OneBitAdam(OneBitOptimizerBase):
    """1-bit Adam, the baseline 0/1 Adam is compared against (DeepSpeed ``OnebitAdam``).

    - ``t = 1``: state is created and the gradient discarded.
    - ``2 <= t <= max(freeze_step, 2)``: full Adam (no bias correction) on gradients the DDP hook
      all-reduced in full precision.
    - later: the variance is frozen; ``m = b1 m + (1-b1) g_local`` goes through the 1-bit error-feedback
      all-reduce every step and ``w -= lr (m / (sqrt(v) + eps) + wd w)``. Replicas stay bit-identical.
    - ``variance_bias_correction``: ``sqrt(v)`` is divided by ``sqrt(1 - b2^k)`` on every step, ``k`` the
      variance updates so far (``max(freeze_step, 2) - 1`` once frozen).

    Args:
        params: parameters or param groups (``lr``, ``betas``, ``eps``, ``weight_decay``, ``exp_avg_mask``).
        config: a :class:`OneBitAdamConfig`, used as given (keyword arguments replace its fields). Without
            one: keyword arguments (``lr``, ``freeze_step``, ...), then ``QACCEL_ONEBIT_ADAM_<FIELD>``
            variables, then the recipe's ``onebit_adam`` section, then the defaults.
        recipe: as for :class:`qaccel.optim.ZeroOneAdam` (section ``onebit_adam``).
        process_group, wire_meter: as for :class:`qaccel.optim.ZeroOneAdam`.

    DeepSpeed's per-group ``non_freeze`` key (full-precision all-reduce for some groups) is not
    supported and raises.

    Example::

        optimizer = OneBitAdam(model.parameters(), lr=1e-3, freeze_step=23000)
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        config: OneBitAdamConfig | None = None,
        *,
        recipe: str | os.PathLike | Mapping[str, Any] | None = None,
        process_group: dist.ProcessGroup | None = None,
        wire_meter: WireMeter | None = None,
        **kwargs: Any,
    ) -> None:
        cfg: OneBitAdamConfig = OneBitAdamConfig.resolve(config, kwargs, recipe=recipe)
        schedule = OneBitAdamSchedule(freeze_step=cfg.freeze_step)
        super().__init__(params, cfg, schedule, process_group=process_group, wire_meter=wire_meter)

    def _compressed_payload(self, kind: StepKind, unit: Unit, grad: torch.Tensor) -> torch.Tensor:
        """The momentum ``m = b1 m + (1-b1) g`` (updated in the state, which is returned)."""
        exp_avg = self.state[unit.anchor]["exp_avg"]
        update_momentum(exp_avg, grad, self._group_of(unit)["betas"][0])
        return exp_avg

    def _apply_averaged(self, kind: StepKind, unit: Unit, averaged: torch.Tensor) -> None:
        group, state = self._group_of(unit), self.state[unit.anchor]
        state["exp_avg"].copy_(averaged)
        mask = unit_mask(unit, group)
        if mask is not None:
            state["exp_avg"].mul_(mask)
        self._descend(unit, state, group, kind)
