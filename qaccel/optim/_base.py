"""What 0/1 Adam and 1-bit Adam share: units, lazy state, the 1-bit all-reduce, clipping, the step driver.

The subclasses only choose the schedule and implement the halves of a compressed step
(``_compressed_payload``, ``_apply_averaged``) and, for 0/1 Adam, ``_step_local``, with the free functions
of :mod:`qaccel.optim._functional`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from .._torch_internals import foreach_mul_, foreach_norm
from ..comm import OneBitLayout, WireMeter, compressed_allreduce, default_meter, onebit_layout, ring_all_reduce_bytes
from ._functional import adam_direction, descend, update_moments
from ._overlap import OneBitOverlap
from ._resume import ResumeMixin
from ._schedule import CommPlan, OneBitAdamSchedule, StepKind, ZeroOneAdamSchedule
from ._units import Unit, build_units, unit_grad, unit_params_as_weights, unit_weights, write_back
from .config import _OneBitConfigBase

__all__ = ["OneBitOptimizerBase", "COMPRESSED_KINDS"]

COMPRESSED_KINDS = frozenset({StepKind.ONEBIT_GRADIENT, StepKind.ONEBIT_MOMENTUM, StepKind.SYNC})
"""Step kinds that issue the 1-bit all-reduce (every rank must join it)."""

# Keys DeepSpeed param groups may carry that we cannot honour with these values.
_GROUP_KEYS_REJECTED = {"non_freeze": (False,), "bias_correction": (False,), "eps_inside_sqrt": (False,), "amsgrad": (False,)}


class OneBitOptimizerBase(ResumeMixin, torch.optim.Optimizer):
    """Base class; see :class:`qaccel.optim.ZeroOneAdam` and :class:`qaccel.optim.OneBitAdam`."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        config: _OneBitConfigBase,
        schedule: ZeroOneAdamSchedule | OneBitAdamSchedule,
        process_group: dist.ProcessGroup | None = None,
        wire_meter: WireMeter | None = None,
    ) -> None:
        self.config = config
        self.schedule = schedule
        self.comm_plan = CommPlan(schedule)
        self.wire_meter = default_meter if wire_meter is None else wire_meter
        self._last_grad_norm: torch.Tensor | float | None = None
        self._process_group = process_group
        self._shard_group: dist.ProcessGroup | None = None
        self._kind_prefix = "onebit"
        self._comm_hook_required = False
        self._comm_hook_installed = False
        self._overlap: OneBitOverlap | None = None
        self._units: list[Unit] | None = None
        self._init_resume_state()
        defaults = dict(lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay)
        super().__init__(params, defaults)

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

    # ----------------------------------------------------------------------------- topology
    def set_process_group(self, process_group: dist.ProcessGroup | None) -> None:
        """Communicate over ``process_group`` (the DDP model's group); None means the default group."""
        self._process_group = process_group

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        return self._process_group

    def set_shard_group(self, shard_group: dist.ProcessGroup) -> None:
        """Parameters sharded over ``shard_group`` (HSDP: the ranks of one node), replicated over the process group.

        :func:`qaccel.optim.register_hsdp_comm_hook` calls this. Gradient norms for clipping then add the
        shards' squares over ``shard_group``; the 1-bit all-reduce, the replica checks and every other
        collective stay on the process group (the replicas of this rank's shard), whose bytes the meter
        records as ``hsdp.onebit.*`` (inter-node).
        """
        self._shard_group = shard_group
        self._kind_prefix = "hsdp.onebit"

    @property
    def shard_group(self) -> dist.ProcessGroup | None:
        return self._shard_group

    @property
    def is_sharded(self) -> bool:
        """Runs on HSDP shards (:meth:`set_shard_group` was called): every rank's state is its own."""
        return self._shard_group is not None

    def shard_ranks(self) -> int:
        """Ranks the parameters are sharded over (1 for DDP replicas)."""
        return dist.get_world_size(self._shard_group) if self._shard_group is not None else 1

    def require_comm_hook(self) -> None:
        """Refuse to step until :func:`qaccel.optim.register_ddp_comm_hook` has run (multi-process runs)."""
        self._comm_hook_required = True

    @property
    def comm_hook_installed(self) -> bool:
        return self._comm_hook_installed

    def _mark_comm_hook_installed(self) -> None:
        self._comm_hook_installed = True

    def world_size(self) -> int:
        """Ranks that average: the group's size, or 1 when torch.distributed is not initialized."""
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self._process_group)

    def _units_now(self) -> list[Unit]:
        if self._units is None:
            self._units = build_units(self.param_groups, self.config.granularity)
        return self._units

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
    def _onebit_buffers(
        self, units: list[Unit], world_size: int
    ) -> tuple[list[OneBitLayout], list[torch.Tensor], list[torch.Tensor]]:
        """Layouts and (created on first use) worker and server error buffers of ``units``."""
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
        layouts, worker_errors, server_errors = self._onebit_buffers(units, world_size)
        return compressed_allreduce(
            payloads, worker_errors, server_errors, layouts, group=self._process_group, meter=self.wire_meter,
            kind_prefix=self._kind_prefix,
        )  # fmt: skip

    def _clip(self, grads: list[torch.Tensor | None], kind: StepKind, world_size: int) -> list[torch.Tensor | None]:
        """Scale the gradients, in place, to ``gradient_clipping`` with a norm that is the same on every rank.

        With sharded parameters (HSDP) "gradient" means the node's: the squares of the shards' norms are
        first summed over the shard group (one 4-byte all-reduce inside the node), then:

        FULL steps: the norm of the all-reduced gradient (identical everywhere). Steps whose local
        gradient feeds a 1-bit all-reduce (0/1 Adam phase 1, 1-bit Adam after the freeze): the root mean
        square of the ranks' local norms, sqrt(mean_r ||g_r||^2), from one 4-byte all-reduce. 0/1 Adam
        phase 2: the rank's own norm (its gradient only moves the local replica until the next sync,
        and an all-reduce here would add a communication round to every local step).

        As ``torch.nn.utils.clip_grad_norm_``: the coefficient ``min(1, max_norm / (norm + 1e-6))`` stays a
        tensor and multiplies every gradient (by exactly 1 when the norm is small), so the decision never
        needs the norm on the host.
        """
        max_norm = self.config.gradient_clipping
        if max_norm <= 0:
            self._last_grad_norm = None
            return grads
        live = [g for g in grads if g is not None]
        if not live:
            self._last_grad_norm = 0.0
            return grads
        norm = torch.linalg.vector_norm(torch.stack(foreach_norm(live)))
        if self._shard_group is not None and dist.get_world_size(self._shard_group) > 1:
            squared = (norm * norm).reshape(1)
            dist.all_reduce(squared, group=self._shard_group)
            nbytes = ring_all_reduce_bytes(4, dist.get_world_size(self._shard_group))
            self.wire_meter.record("onebit.clip_norm_shard_all_reduce", sent_bytes=nbytes, recv_bytes=nbytes)
            norm = torch.sqrt(squared[0])
        if kind in (StepKind.ONEBIT_GRADIENT, StepKind.ONEBIT_MOMENTUM) and world_size > 1:
            squared = (norm * norm).reshape(1)
            dist.all_reduce(squared, group=self._process_group)
            self.wire_meter.record(
                f"{self._kind_prefix}.clip_norm_all_reduce",
                sent_bytes=ring_all_reduce_bytes(4, world_size),
                recv_bytes=ring_all_reduce_bytes(4, world_size),
            )
            norm = torch.sqrt(squared[0] / world_size)
        self._last_grad_norm = norm
        foreach_mul_(live, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
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
        if self._comm_hook_required and not self._comm_hook_installed:
            raise RuntimeError(
                f"{type(self).__name__}: no DDP model holding these parameters was prepared, so nothing decides "
                "when gradients are all-reduced; pass the model to accelerator.prepare (or call "
                "qaccel.optim.register_ddp_comm_hook)"
            )
        kind = self.schedule.next_kind()
        units = self._units_now()
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
            self._descend(unit, state, group)

    def _descend(self, unit: Unit, state: dict, group: dict) -> None:
        """``w -= lr (m / (sqrt(v) + eps) + wd w)`` on the unit's working weights, written back."""
        weights = unit_weights(unit, state)
        descend(weights, adam_direction(state["exp_avg"], state["exp_avg_sq"], weights, group["eps"], group["weight_decay"]), group["lr"])
        write_back(unit, weights)

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
        payloads = [self._compressed_payload(kind, unit, grad) for unit, grad in rest]
        averaged = dict(started)
        averaged.update(zip([unit for unit, _ in rest], self._average_1bit([unit for unit, _ in rest], payloads, world_size), strict=True))
        for unit in units:
            if unit in averaged:
                self._apply_averaged(kind, unit, averaged[unit])

    # ------------------------------------------------------------------------------ overlap
    def _enable_overlap(self, group: dist.ProcessGroup) -> None:
        """Start 1-bit all-reduces in the DDP hook, on ``group`` (:func:`register_ddp_comm_hook` calls this)."""
        self._overlap = OneBitOverlap(self, group)

    @property
    def comm_overlap(self) -> OneBitOverlap | None:
        """The backward overlap of the 1-bit all-reduce, when the DDP hook installed one (``overlap_comm``)."""
        return self._overlap

    def disable_comm_overlap(self, reason: str) -> None:
        """Run the 1-bit all-reduce in the step again from the next backward on (logs ``reason`` if a round is in flight)."""
        if self._overlap is not None:
            self._overlap.disable(reason)

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
