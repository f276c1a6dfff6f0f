"""Install QSDP comms on every FSDP2 unit of a model, and the optimizer step post-hook.

``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter`` set one unit only (they do
not recurse), so the installer walks ``model.modules()``. Units whose gradients are quantized get
``set_force_sum_reduction_for_comms(True)``: the comm is then a SUM transport, and FSDP2 divides
the summed shard itself, by the data-parallel size or by the factor the user set with
``set_gradient_divide_factor`` (``docs/qsdp.md``, "Reduce-scatter"). The divide factor is never
touched. Units left on the stock path keep FSDP's reduce op too, so they stay bit-identical.

What QSDP cannot do right is refused here, before any collective, instead of degrading silently
(``docs/qsdp.md``, "What is refused"): HSDP / 2-D meshes and several param groups per unit
(:func:`find_units`), and on a quantized unit: parameters all-gathered in different dtypes,
tensor-subclass all-gather extensions, and ``reshard_after_forward=<int>``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .. import _torch_internals as torch_internals
from ..comm import BufferPool, PhaseTimer, WireMeter, default_meter
from ._comms import QuantizedAllGather, QuantizedReduceScatter, UnitPlan
from ._master import requantize_shards
from ._prefetch import apply_prefetch
from ._replica import ReplicaAllReduce
from ._rs_overlap import ReduceScatterOverlap
from ._seeds import SeedSchedule
from ._units import FSDPUnit, HookOwner, check_replica_group, find_units, require_custom_comms
from .config import QSDPConfig

__all__ = ["QSDPHandle", "install_qsdp"]

logger = logging.getLogger(__name__)


@dataclass
class QSDPHandle:
    """What :func:`install_qsdp` installed: units, their plans and comms, and the seed schedule.

    ``state_dict()`` / ``load_state_dict()`` carry the step and gradient-call counters and the
    config, so a resumed run draws the same rounding noise as an uninterrupted one; a changed QSDP
    config is refused. The only per-rank state is gradient error feedback
    (``QSDPConfig.grad_error_feedback``): :meth:`error_state` / :meth:`load_error_state`, one file per
    rank in a checkpoint. Without it a run may resume on another world size; with it the buffers
    then restart from zero, with a warning.
    """

    config: QSDPConfig
    units: list[FSDPUnit]
    plans: list[UnitPlan]
    all_gathers: list[QuantizedAllGather]
    reduce_scatters: list[QuantizedReduceScatter]
    seeds: SeedSchedule
    world_size: int
    replica_all_reduces: list[ReplicaAllReduce] = field(default_factory=list)
    replicas: int = 1
    reduce_scatter_overlap: ReduceScatterOverlap | None = None  # QSDPConfig.overlap_reduce_scatter
    # Per unit, the reduce-scatter's plan: the parameters that require grad (the all-gather's ``plans``
    # cover all of them); the same object as the unit's plan when none is frozen.
    grad_plans: list[UnitPlan] = field(default_factory=list)
    _hooks: list = field(default_factory=list)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Advance the seeds (and re-round mode-B shards) after each step of ``optimizer``."""
        self._hooks.append(optimizer.register_step_post_hook(lambda *_: self.after_optimizer_step()))

    def after_optimizer_step(self) -> None:
        """Mode ``quantized``: put every quantized unit's shard on its grid; then advance the step."""
        codec = self.config.weight_codec()
        if self.config.master_weights == "quantized" and codec is not None:
            for unit, plan in zip(self.units, self.plans, strict=True):
                if plan.enabled and unit.params:
                    rank = unit.params[0].device_mesh.get_local_rank()
                    requantize_shards(unit, plan, codec, self.seeds.master_seed(unit.index, rank))
        self.seeds.advance()

    def describe(self) -> list[dict]:
        """Per unit: name, shard elements (all, and those with gradients), quantized elements, and which paths are quantized."""
        return [
            {
                "unit": plan.name,
                "shard_numel": sum(n for n, _ in plan.segments),
                "quantized_numel": sum(n for n, q in plan.segments if q),
                # what the reduce-scatter carries: frozen parameters (adapters, LoRA) have no gradient
                "grad_shard_numel": sum(n for n, _ in rs.plan.segments),
                "weights_quantized": ag.codec is not None,
                "grads_quantized": rs.codec is not None,
                # what gradient error feedback holds on this rank: (P-1) chunks of the reduce-scatter
                "error_feedback_bytes": (
                    (self.world_size - 1) * sum(n for n, _ in rs.plan.segments) * rs.error_dtype.itemsize if rs.error_dtype is not None else 0
                ),
                **({"replica_grads_quantized": ar.codec is not None} if ar is not None else {}),
            }
            for plan, ag, rs, ar in zip(
                self.plans, self.all_gathers, self.reduce_scatters, self.replica_all_reduces or [None] * len(self.plans), strict=True
            )
        ]

    def error_state(self) -> dict[str, torch.Tensor]:
        """This rank's error-feedback buffers, ``{"unit<index>": tensor}`` (empty without error feedback)."""
        return {f"unit{rs.plan.index}": rs.error for rs in self.reduce_scatters if rs.error is not None}

    def load_error_state(self, tensors: dict[str, torch.Tensor], saved_world_size: int) -> None:
        """Restore this rank's error-feedback buffers saved on ``saved_world_size`` ranks.

        On another world size each rank's chunks (and their errors) belong to other ranks, so every
        buffer restarts from zero, with a warning; the seeds still resume exactly.
        """
        if saved_world_size != self.world_size:
            logger.warning(
                "QSDP: the checkpoint's gradient error-feedback buffers were saved on %d ranks, this run has %d: they "
                "restart from zero (the rounding errors of the last step are dropped once)", saved_world_size, self.world_size,
            )  # fmt: skip
            tensors = {}
        for rs in self.reduce_scatters:
            rs.load_error_state(tensors.get(f"unit{rs.plan.index}"))

    def error_feedback_nbytes(self) -> int:
        """Bytes this rank holds for gradient error feedback (0 before the first step or without it)."""
        return sum(rs.error.numel() * rs.error.element_size() for rs in self.reduce_scatters if rs.error is not None)

    def state_dict(self) -> dict:
        return {"seeds": self.seeds.state_dict(), "world_size": self.world_size, "replicas": self.replicas, "config": self.config.to_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the counters; raise ValueError naming every QSDP setting that changed since the save."""
        saved = QSDPConfig.from_dict(state["config"], source="QSDP checkpoint")
        changed = saved.differences(self.config)
        if changed:
            listed = "; ".join(f"{name}: saved {old!r}, now {new!r}" for name, (old, new) in changed.items())
            raise ValueError(
                f"QSDP checkpoint: saved with a different QSDP config ({listed}); resuming with other QSDP "
                "settings would not continue the saved run. Resume with the saved settings, or start a new run"
            )
        # The world size and replica count are informative only: no QSDP state depends on them.
        self.seeds.load_state_dict(state["seeds"])

    def set_phase_timer(self, timer: PhaseTimer | None) -> None:
        """Split every collective's time into encode / transport / decode into ``timer`` (None: off)."""
        for comm in (*self.all_gathers, *self.reduce_scatters, *self.replica_all_reduces):
            comm.timer = timer

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def install_qsdp(
    model: nn.Module,
    config: QSDPConfig,
    *,
    optimizers: Iterable[torch.optim.Optimizer] = (),
    meter: WireMeter | None = None,
    replica_group: dist.ProcessGroup | None = None,
) -> QSDPHandle:
    """Give every FSDP2 unit of ``model`` a QSDP all-gather and reduce-scatter.

    Call after ``fully_shard`` (or ``accelerator.prepare``) and before the first forward. Every
    check runs before any collective. With ``config.prefetch`` (the default) the units also
    prefetch each other's all-gathers asynchronously (:func:`qaccel.fsdp.apply_prefetch`).

    Hierarchical QSDP (HSDP, ``docs/qsdp.md``, "Hierarchical QSDP"): shard the units on the 1-D
    intra-node mesh and pass the replica group (the ranks that hold this rank's shard on the other
    nodes). Every unit then sums its gradient shard over the replicas in an all-reduce hook
    (:class:`ReplicaAllReduce`, ``config.replica_grad_bits``), reduces with SUM inside the node, and
    FSDP2 divides by ``S * R`` (unless a gradient divide factor was set on the unit: that one is kept).

    Args:
        model: a model whose units were sharded with ``fully_shard`` on a 1-D mesh.
        config: the QSDP settings.
        optimizers: optimizers whose steps advance the seeds (and re-round mode-B shards).
        meter: where bytes are recorded (default: the process-wide meter).
        replica_group: hierarchical QSDP's replica process group (size R >= 2), or None for 1-D QSDP.

    Returns:
        A :class:`QSDPHandle`.

    Raises:
        RuntimeError: torch without FSDP2 custom comms.
        ValueError: ``model`` has no FSDP2 unit, a unit already has another custom comm or
            all-reduce hook, or ``replica_group`` does not pair this rank's shard group with one rank
            per replica.
        NotImplementedError: native HSDP (a 2-D mesh), several param groups in a unit, or a quantized unit
            whose parameters are all-gathered in different dtypes, that uses tensor-subclass
            all-gather extensions, or that was sharded with ``reshard_after_forward=<int>``.

    Example::

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        handle = install_qsdp(model, QSDPConfig(weight_bits=8, grad_bits=8), optimizers=[opt])
    """
    require_custom_comms()
    if not isinstance(config, QSDPConfig):
        raise TypeError(f"install_qsdp: config must be a QSDPConfig, got {type(config).__name__}")
    units = find_units(model)
    if not units:
        raise ValueError(f"install_qsdp: {type(model).__name__} has no FSDP2 unit; call fully_shard (or accelerator.prepare with an FSDP2 plugin) first")
    meter = default_meter if meter is None else meter
    seeds = SeedSchedule(config.seed)
    world_size = max(unit.world_size for unit in units)
    replicas = _check_replica_group(units, replica_group)
    shard_rank = units[0].params[0].device_mesh.get_local_rank() if replicas > 1 and units[0].params else 0
    owner_offset = replica_group.rank() * world_size if replicas > 1 else 0
    buffers = BufferPool()  # one per model: units of equal size share their buffers
    # One per model: pending reduce-scatters finish in the order they started, whichever unit.
    overlap = ReduceScatterOverlap() if config.overlap_reduce_scatter else None
    plans, all_gathers, reduce_scatters, replica_all_reduces = [], [], [], []
    grad_plans = []
    for unit in units:
        plan, grad_plan = _unit_plans(unit, config)
        all_gather = QuantizedAllGather(plan, config.weight_codec(), seeds, meter, buffers)
        reduce_scatter = QuantizedReduceScatter(grad_plan, config.grad_codec(), seeds, meter, buffers, config.error_feedback_dtype())
        refuse_unsupported(unit, weights_quantized=all_gather.codec is not None, grads_quantized=reduce_scatter.codec is not None)
        reduce_scatter.owner_offset = owner_offset
        all_gather.overlap = reduce_scatter.overlap = overlap
        # find_units refused units with several param groups: one, or none for a unit without parameters
        # (which never reduce-scatters).
        groups = torch_internals.param_groups(torch_internals.fsdp_state(unit.modules[0]))
        reduce_scatter.param_group = groups[0] if groups else None
        plans.append(plan)
        grad_plans.append(grad_plan)
        all_gathers.append(all_gather)
        reduce_scatters.append(reduce_scatter)
        if replicas > 1:
            owner = owner_offset + shard_rank
            # the all-reduce hook sums the reduce-scatter's output: the gradient plan's layout
            replica_all_reduces.append(ReplicaAllReduce(grad_plan, config.replica_grad_codec(), seeds, meter, replica_group, owner, buffers))
    # Every check passed: only now change the units.
    for index, (unit, all_gather, reduce_scatter) in enumerate(zip(units, all_gathers, reduce_scatters, strict=True)):
        for module in unit.modules:
            if reduce_scatter.needs_forced_sum or replicas > 1:
                # SUM transport; FSDP2 divides afterwards (by P, or the user's gradient divide factor).
                module.set_force_sum_reduction_for_comms(True)
            if replicas > 1:
                # FSDP2 on the 1-D mesh would divide by S only; the hook summed over R replicas too.
                if unit.gradient_divide_factor is None:
                    module.set_gradient_divide_factor(float(world_size * replicas))
                module.set_all_reduce_hook(replica_all_reduces[index])
            module.set_custom_all_gather(all_gather)
            module.set_custom_reduce_scatter(reduce_scatter)
    if config.prefetch:
        apply_prefetch(model)
    handle = QSDPHandle(
        config, units, plans, all_gathers, reduce_scatters, seeds, world_size, replica_all_reduces, replicas, overlap, grad_plans=grad_plans
    )
    for optimizer in optimizers:
        handle.attach_optimizer(optimizer)
    logger.debug("QSDP installed on %d FSDP units: %s", len(units), handle.describe())
    return handle


def _unit_plans(unit: FSDPUnit, config: QSDPConfig) -> tuple[UnitPlan, UnitPlan]:
    """The unit's all-gather plan (every parameter) and reduce-scatter plan (those that require grad).

    FSDP2 all-gathers every parameter of a unit but reduce-scatters only the gradients it has, in
    ``fsdp_params`` order (``FSDPParamGroup.post_backward``), each padded like its shard. With
    frozen parameters (LoRA adapters over a frozen base) the gradient buffer is the trainable
    parameters' shards alone, so its plan is built from those; a plan over all of them would not
    match the buffer and fall back to uniform buckets. A parameter frozen or unfrozen after the
    install still meets that fallback (with its warning) rather than a wrong map.
    """
    shapes, shard_numels = [p.shape for p in unit.params], unit.shard_numels()

    def build(keep: list[bool]) -> UnitPlan:
        return UnitPlan.build(
            unit.index,
            unit.name,
            [s for s, k in zip(shapes, keep, strict=True) if k],
            [n for n, k in zip(shard_numels, keep, strict=True) if k],
            param_min_numel=config.param_min_numel,
            unit_min_numel=config.unit_min_numel,
        )

    plan = build([True] * len(shapes))
    trainable = unit.trainable()
    return plan, plan if all(trainable) else build(trainable)


def _check_replica_group(units: list[FSDPUnit], replica_group: dist.ProcessGroup | None) -> int:
    """The replica count R (1 without a group); raise ValueError when the group cannot be the replicas of this rank's shard.

    Local checks only (no collective): no other all-reduce hook, and :func:`check_replica_group`.
    """
    if replica_group is None or dist.get_world_size(replica_group) == 1:
        return 1  # 1-D QSDP leaves the all-reduce hook alone (a sharded 1-bit optimizer may own it)
    foreign = [
        (unit.name, unit.all_reduce_hook, unit.all_reduce_hook_owner)
        for unit in units
        if unit.all_reduce_hook_owner not in (None, HookOwner.HIERARCHICAL_QSDP)
    ]
    if foreign:
        name, hook, owner = foreign[0]
        advice = (
            "A sharded 1-bit optimizer (register_hsdp_comm_hook) already owns the traffic across replicas: install "
            "QSDP without replica_group"
            if owner is HookOwner.ONEBIT_OPTIMIZER
            else "Remove it"
        )
        raise ValueError(
            f"install_qsdp(replica_group=...): FSDP unit {name} already has an all-reduce hook ({hook}, "
            f"set_all_reduce_hook); hierarchical QSDP cannot combine it with its own. {advice}"
        )
    return check_replica_group(units, replica_group, "install_qsdp")


def refuse_unsupported(unit: FSDPUnit, *, weights_quantized: bool, grads_quantized: bool) -> None:
    """Raise NotImplementedError for a quantized unit whose FSDP2 buffers QSDP cannot read correctly.

    - Several all-gather dtypes: FSDP2 then gathers one uint8 byte buffer, so the segment map (in
      elements of one dtype) no longer matches it. Stock FSDP2 also refuses to reduce-scatter
      gradients of several dtypes.
    - Tensor-subclass all-gather extensions (``fsdp_pre_all_gather``): the all-gather input is
      not the parameter's shard.
    - ``reshard_after_forward=<int>``: after forward every rank keeps a slice of the *decoded*
      weights and backward re-gathers those within a smaller group, so the backward weights are no
      longer bit-identical to the forward ones (only with quantized weights).
    """
    if not (weights_quantized or grads_quantized):
        return
    dtypes = set(unit.all_gather_dtypes)
    if len(dtypes) > 1:
        listed = ", ".join(f"{name}: {dtype}" for name, dtype in zip(unit.param_names, unit.all_gather_dtypes, strict=False))
        raise NotImplementedError(
            f"QSDP: FSDP unit {unit.name} all-gathers parameters of several dtypes ({listed}); FSDP2 then moves "
            "one byte buffer that QSDP's per-element segment map cannot read. Give the unit one dtype (cast the "
            "module, or a MixedPrecisionPolicy with param_dtype), or turn both QSDP paths off"
        )
    if unit.custom_extension and weights_quantized:
        raise NotImplementedError(
            f"QSDP: FSDP unit {unit.name} has parameters with tensor-subclass all-gather extensions "
            f"(fsdp_pre_all_gather: {', '.join(unit.custom_extension)}); QSDP quantizes plain shards only. "
            "Set weight_bits='off' for such a model"
        )
    if unit.reshard_after_forward_size is not None and weights_quantized:
        raise NotImplementedError(
            f"QSDP: FSDP unit {unit.name} was sharded with reshard_after_forward={unit.reshard_after_forward_size} "
            "(an int): backward would re-gather already decoded weights within a smaller group, so forward and "
            "backward would no longer compute with bit-identical weights. Use reshard_after_forward=True or False, "
            "or weight_bits='off'"
        )
