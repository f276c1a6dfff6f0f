"""What 0/1 Adam and 1-bit Adam share: units, lazy state, the 1-bit all-reduce, clipping, the step driver.

The subclasses only choose the schedule and implement the halves of a compressed step
(``_compressed_payload``, ``_apply_averaged``) and, for 0/1 Adam, ``_step_local``, with the free functions
of :mod:`qaccel.optim._functional`. Transports (the DDP and HSDP hooks, the backward overlap) use the
public port of :mod:`qaccel.optim._port` only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from ..comm import OneBitLayout, WireMeter, compressed_allreduce, default_meter, onebit_layout
from ._clip import clip_to_consistent_norm
from ._functional import adam_direction, descend, update_moments
from ._overlap import OneBitOverlap, overlap_group
from ._port import OneBitPlacement
from ._resume import ResumeMixin
from ._schedule import COMPRESSED_KINDS, CommPlan, OneBitAdamSchedule, StepKind, ZeroOneAdamSchedule
from ._units import Unit, build_units, unit_grad, unit_params_as_weights, unit_weights, write_back
from ._variance_bias import log_frozen_variance_factor
from .config import OneBitConfigBase

__all__ = ["OneBitOptimizerBase", "COMPRESSED_KINDS"]

# Keys DeepSpeed param groups may carry that we cannot honour with these values.
_GROUP_KEYS_REJECTED = {"non_freeze": (False,), "bias_correction": (False,), "eps_inside_sqrt": (False,), "amsgrad": (False,)}


class OneBitOptimizerBase(ResumeMixin, torch.optim.Optimizer):
    """Base class; see :class:`qaccel.optim.ZeroOneAdam` and :class:`qaccel.optim.OneBitAdam`.

    It implements :class:`qaccel.optim.OneBitPort`, all its transports use, and runs on the constructor's
    group and meter until a comm hook attaches it to a :class:`qaccel.optim.OneBitPlacement` (once).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        config: OneBitConfigBase,
        schedule: ZeroOneAdamSchedule | OneBitAdamSchedule,
        process_group: dist.ProcessGroup | None = None,
        wire_meter: WireMeter | None = None,
    ) -> None:
        self.config = config
        self.schedule = schedule
        self.comm_plan = CommPlan(schedule)
        self._last_grad_norm: torch.Tensor | float | None = None
        # Where it runs until a comm hook attaches it (attach); the constructor's group and meter.
        self._placement = OneBitPlacement(
            process_group=process_group, wire_meter=default_meter if wire_meter is None else wire_meter
        )
        self._attached = False
        self._overlap: OneBitOverlap | None = None
        self._units: list[Unit] | None = None
        self._init_resume_state()
        defaults = dict(lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay)
        super().__init__(params, defaults)
        log_frozen_variance_factor(config)

    # ----------------------------------------------------------------------------------- groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; ``lr``, ``betas``, ``eps``, ``weight_decay`` and ``exp_avg_mask`` may be set per group.

        ``exp_avg_mask`` (DeepSpeed's per-group key) multiplies the output of every 1-bit all-reduce of the
        group, so masked coordinates whose gradient is always 0 keep a zero momentum (1-bit signs cannot
        encode 0). The group must hold exactly one parameter, and the mask that parameter's numel.
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        where = f"{type(self).__name__} param group {len(self.param_groups) - 1}"
        lr, betas, eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or lr < 0:
            raise ValueError(f"{where}: lr={lr!r}: must be a number >= 0")
        if len(tuple(betas)) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"{where}: betas={betas!r}: must be two numbers in [0, 1)")
        if not eps > 0:
            raise ValueError(f"{where}: eps={eps!r}: must be > 0")
        if not weight_decay >= 0:
            raise ValueError(f"{where}: weight_decay={weight_decay!r}: must be >= 0")
        for key, allowed in _GROUP_KEYS_REJECTED.items():
            if key in group and group[key] not in allowed:
                raise NotImplementedError(f"{where}: {key}={group[key]!r}: only {allowed} is supported")
        if "exp_avg_mask" in group:
            mask, params = group["exp_avg_mask"], group["params"]
            if not isinstance(mask, torch.Tensor):
                raise TypeError(f"{where}: exp_avg_mask must be a torch.Tensor, got {type(mask).__name__}")
            if len(params) != 1 or mask.numel() != params[0].numel():
                raise ValueError(
                    f"{where}: exp_avg_mask has {mask.numel()} elements; the group must hold exactly one parameter "
                    f"with that many elements (it holds {len(params)} with {[p.numel() for p in params]})"
                )
        self._units = None

    # ------------------------------------------------------------------------------ placement
    def attach(self, placement: OneBitPlacement) -> None:
        """Run on ``placement`` from now on: :func:`register_ddp_comm_hook` / :func:`register_hsdp_comm_hook` call this.

        Once per optimizer: attaching the same placement again does nothing, another one raises. With
        ``placement.overlap_comm`` it creates the overlap thread's process group (a collective: every rank
        of ``placement.process_group`` attaches, as every rank registers the hook).

        Raises:
            RuntimeError: the optimizer already runs on another placement.
        """
        if not isinstance(placement, OneBitPlacement):
            raise TypeError(f"{type(self).__name__}.attach: expected a OneBitPlacement, got {type(placement).__name__}")
        if self._attached:
            if placement.same_as(self._placement):
                return
            raise RuntimeError(
                f"{type(self).__name__}.attach: already runs on {self._placement!r}, not {placement!r}; a 1-bit "
                "optimizer's error feedback belongs to one group: build a new optimizer for another model"
            )
        if placement.overlap_comm:
            self._overlap = OneBitOverlap(self, overlap_group(placement.process_group))
        self._placement = placement
        self._attached = True

    @property
    def placement(self) -> OneBitPlacement:
        """Where the optimizer runs: the constructor's group and meter until a comm hook attaches it."""
        return self._placement

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        return self._placement.process_group

    @property
    def shard_group(self) -> dist.ProcessGroup | None:
        return self._placement.shard_group

    @property
    def wire_meter(self) -> WireMeter:
        """Where the optimizer's collectives record their bytes (the placement's meter)."""
        return self._placement.wire_meter

    @property
    def is_sharded(self) -> bool:
        """Runs on HSDP shards (attached with a shard group): every rank's state is its own."""
        return self._placement.shard_group is not None

    def shard_ranks(self) -> int:
        """Ranks the parameters are sharded over (1 for DDP replicas)."""
        shard_group = self._placement.shard_group
        return dist.get_world_size(shard_group) if shard_group is not None else 1

    @property
    def comm_hook_installed(self) -> bool:
        """A comm hook attached the optimizer (:meth:`attach`): it decides when gradients are all-reduced."""
        return self._attached

    def world_size(self) -> int:
        """Ranks that average: the group's size, or 1 when torch.distributed is not initialized."""
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self._placement.process_group)

    def set_gradient_clipping(self, max_norm: float) -> None:
        """Clip at ``max_norm`` from the next step on (``config.gradient_clipping``; 0 disables).

        ``qaccel.Trainer`` hands ``TrainingArguments.max_grad_norm`` over here. The config is replaced
        (``dataclasses.replace``, validated again), never changed in place.
        """
        self.config = dataclasses.replace(self.config, gradient_clipping=max_norm)

    # ---------------------------------------------------------------------------------- port
    def units(self) -> list[Unit]:
        """The units of the optimizer's state, in step order (what one payload covers)."""
        if self._units is None:
            self._units = build_units(self.param_groups, self.config.granularity)
        return self._units

    def unit_payload(self, kind: StepKind, unit: Unit, grad: torch.Tensor) -> torch.Tensor:
        """What ``unit`` sends through the 1-bit all-reduce on a step of ``kind``, its state created and updated."""
        self._ensure_state(unit)
        return self._compressed_payload(kind, unit, grad)

    def overlap_blocker(self) -> str | None:
        """Why the next step's payloads cannot be formed in backward, or None (:mod:`qaccel.optim._overlap`)."""
        if self.world_size() == 1:
            return "one rank: the 1-bit all-reduce is the identity, and the step skips it"
        if self.config.gradient_clipping > 0:
            return "gradient_clipping needs the global norm, known only after backward"
        if self._pending_resume is not None:
            return "the first step after loading a checkpoint may reset the replicas first"
        if any(unit.anchor.device.type != "cpu" for unit in self.units()):
            return "overlap runs on CPU (gloo) only"
        return None

    # -------------------------------------------------------------------------------- state
    def _ensure_state(self, unit: Unit) -> dict:
        state = self.state[unit.anchor]
        if "exp_avg" not in state:
            device = unit.anchor.device
            state["exp_avg"] = torch.zeros(unit.shape, dtype=torch.float32, device=device)
            state["exp_avg_sq"] = torch.zeros(unit.shape, dtype=torch.float32, device=device)
            if unit.needs_master:
                state["master_weights"] = unit_params_as_weights(unit)
        self._ensure_phase_state(unit, state)
        return state

    def _ensure_phase_state(self, unit: Unit, state: dict) -> None:
        """Subclass hook: create state that exists only in some phases."""

    def _zero_error_buffers(self, state: dict) -> None:
        for key in ("worker_error", "server_error"):
            if key in state:
                state[key].zero_()

    # ------------------------------------------------------------------------- communication
    def onebit_buffers(self, units: list[Unit]) -> tuple[list[OneBitLayout], list[torch.Tensor], list[torch.Tensor]]:
        """Layouts and (created on first use) worker and server error buffers of ``units`` for the 1-bit all-reduce."""
        world_size = self.world_size()
        layouts, worker_errors, server_errors = [], [], []
        for unit in units:
            state = self.state[unit.anchor]
            layout = onebit_layout(unit.numel, world_size, self.config.padding)
            if state.get("worker_error") is None or state["worker_error"].numel() != layout.padded_numel:
                state["worker_error"], state["server_error"] = layout.new_error_buffers(unit.anchor.device)
            layouts.append(layout)
            worker_errors.append(state["worker_error"])
            server_errors.append(state["server_error"])
        return layouts, worker_errors, server_errors

    def _average_1bit(self, units: list[Unit], payloads: list[torch.Tensor], world_size: int) -> list[torch.Tensor]:
        """C(payloads): the 1-bit error-feedback average over the group, or a fp32 copy when alone."""
        if world_size == 1:
            return [payload.to(torch.float32, copy=True) for payload in payloads]
        layouts, worker_errors, server_errors = self.onebit_buffers(units)
        placement = self._placement
        return compressed_allreduce(
            payloads, worker_errors, server_errors, layouts, group=placement.process_group, meter=placement.wire_meter,
            kind_prefix=placement.kind_prefix,
        )  # fmt: skip

    def _clip(self, grads: list[torch.Tensor | None], kind: StepKind, world_size: int) -> list[torch.Tensor | None]:
        """Scale the gradients, in place, to ``gradient_clipping`` (:func:`clip_to_consistent_norm`)."""
        max_norm = self.config.gradient_clipping
        if max_norm <= 0:
            self._last_grad_norm = None
            return grads
        live = [g for g in grads if g is not None]
        if not live:
            self._last_grad_norm = 0.0
            return grads
        self._last_grad_norm = clip_to_consistent_norm(live, max_norm, kind, world_size, self._placement)
        return grads

    @property
    def last_grad_norm(self) -> float | None:
        """The norm the last step clipped with (None without ``gradient_clipping``); reading it syncs."""
        norm = self._last_grad_norm
        return None if norm is None else float(norm)

    # --------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One optimizer step of the kind the schedule dictates (see :class:`qaccel.optim.StepKind`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        kind = self.schedule.next_kind()
        units = self.units()
        for unit in units:
            self._ensure_state(unit)
        if kind is StepKind.INIT:
            # DeepSpeed's initialization step: state only, the gradient is discarded. Its C(0) warm-up is
            # skipped: it leaves every buffer at zero (``docs/zero_one_adam.md``, "Deviations", 2).
            self.schedule.advance(kind)
            self._pending_resume = None
            return loss
        world_size = self.world_size()
        # units whose 1-bit all-reduce started in backward (overlap_comm): their gradient was read there
        started = self._overlap.collect(kind) if self._overlap is not None else {}
        if self._pending_resume is not None:
            self._finish_resume(units, world_size)
        zeros_if_missing = world_size > 1 and kind in COMPRESSED_KINDS
        grads = [None if unit in started else unit_grad(unit, zeros_if_missing) for unit in units]
        grads = self._clip(grads, kind, world_size)
        if kind is StepKind.FULL:
            self._step_full(units, grads)
        elif kind is StepKind.LOCAL:
            self._step_local(units, grads)
        else:
            self._step_compressed(kind, units, grads, world_size, started)
        if self.schedule.advance(kind):
            for unit in units:
                self._on_freeze(unit, self.state[unit.anchor])
        interval = self.config.replica_check_interval
        if interval and world_size > 1 and self.schedule.step % interval == 0:
            self.check_replicas(units, world_size, f"at step {self.schedule.step}")
        return loss

    def _step_local(self, units: list[Unit], grads: list[torch.Tensor | None]) -> None:
        """A LOCAL step (0/1 Adam phase 2): the subclass's local update, nothing sent."""
        raise NotImplementedError

    def _step_full(self, units: list[Unit], grads: list[torch.Tensor | None]) -> None:
        """A FULL step: Adam moments from the all-reduced gradients, then descend."""
        for unit, grad in zip(units, grads, strict=True):
            if grad is None:
                continue
            group, state = self._group_of(unit), self.state[unit.anchor]
            update_moments(state["exp_avg"], state["exp_avg_sq"], grad, *group["betas"])
            self._descend(unit, state, group, StepKind.FULL)

    def _descend(self, unit: Unit, state: dict, group: dict, kind: StepKind) -> None:
        """``w -= lr (m / (sqrt(v) + eps) + wd w)`` on the unit's working weights, written back."""
        weights = unit_weights(unit, state)
        direction = adam_direction(
            state["exp_avg"], state["exp_avg_sq"], weights, group["eps"], group["weight_decay"], self._variance_correction(kind, group)
        )
        descend(weights, direction, group["lr"])
        write_back(unit, weights)

    def _variance_correction(self, kind: StepKind, group: dict) -> float | None:
        """``sqrt(1 - beta2^k)`` for the ``k`` updates the variance holds during a step of ``kind``, or None.

        None (DeepSpeed's numerics) without ``variance_bias_correction``. ``k`` counts this step's own update
        on a FULL step (the moments update before the descent); a frozen variance keeps its last ``k``.
        """
        updates = self.schedule.variance_updates + (kind is StepKind.FULL)
        if not self.config.variance_bias_correction or updates == 0:
            return None
        return math.sqrt(1.0 - group["betas"][1] ** updates)

    def _compressed_payload(self, kind: StepKind, unit: Unit, grad: torch.Tensor) -> torch.Tensor:
        """What ``unit`` sends through the 1-bit all-reduce on a step of ``kind`` (state updated as needed)."""
        raise NotImplementedError

    def _apply_averaged(self, kind: StepKind, unit: Unit, averaged: torch.Tensor) -> None:
        """Apply the averaged payload of ``unit`` on a step of ``kind``."""
        raise NotImplementedError

    def _step_compressed(
        self,
        kind: StepKind,
        units: list[Unit],
        grads: list[torch.Tensor | None],
        world_size: int,
        started: dict[Unit, torch.Tensor],
    ) -> None:
        """A step with a 1-bit all-reduce: payloads of the units not started in backward, one call, then apply.

        Each unit has its own scale and error buffers, so which call carries it does not change its result.
        """
        rest = [(unit, grad) for unit, grad in zip(units, grads, strict=True) if unit not in started and grad is not None]
        payloads = [self.unit_payload(kind, unit, grad) for unit, grad in rest]
        averaged = dict(started)
        averaged.update(zip([unit for unit, _ in rest], self._average_1bit([unit for unit, _ in rest], payloads, world_size), strict=True))
        for unit in units:
            if unit in averaged:
                self._apply_averaged(kind, unit, averaged[unit])

    # ------------------------------------------------------------------------------ overlap
    @property
    def comm_overlap(self) -> OneBitOverlap | None:
        """The backward overlap of the 1-bit all-reduce, when attached with ``overlap_comm`` (by the DDP hook)."""
        return self._overlap

    def state_dict(self) -> dict[str, Any]:
        if self._overlap is not None:
            self._overlap.refuse_in_flight("state_dict")
        return super().state_dict()

    def rank_state_dict(self) -> dict[str, Any]:
        if self._overlap is not None:
            self._overlap.refuse_in_flight("rank_state_dict")
        return super().rank_state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._overlap is not None:
            self._overlap.refuse_in_flight("load_state_dict")
        super().load_state_dict(state_dict)

    def _on_freeze(self, unit: Unit, state: dict) -> None:
        """Subclass hook at the end of the step that froze the variance."""
        self._zero_error_buffers(state)

    def _group_of(self, unit: Unit) -> dict:
        return self.param_groups[unit.group_index]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r}, schedule={self.schedule!r})"
