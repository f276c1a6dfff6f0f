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

from ..comm import BufferPool, PhaseTimer, WireMeter, default_meter
from ._comms import CountedAllGather, CountedReduceScatter, QuantizedAllGather, QuantizedReduceScatter
from ._master import requantize_shards
from ._plan import UnitPlan
from ._prefetch import apply_prefetch
from ._replica import QuantizedReplicaAllReduce, ReplicaAllReduce
from ._rs_overlap import ReduceScatterOverlap
from ._seeds import SeedSchedule
from ._unit_comms import SharedComms, build_unit_comms
from ._units import FSDPUnit, HookOwner, check_replica_group, find_units, require_custom_comms, shard_group
from .config import QSDPConfig

__all__ = ["QSDPHandle", "install_qsdp"]

logger = logging.getLogger(__name__)


@dataclass
class QSDPHandle:
    """What :func:`install_qsdp` installed: units, their plans and comms, and the seed schedule.

    ``state_dict()`` / ``load_state_dict()`` carry the step and gradient-call counters and the
    config, so a resumed run draws the same rounding noise as an uninterrupted one; a changed QSDP
    config is refused. ``all_gathers`` / ``reduce_scatters`` hold each unit's transport: quantized, or
    FSDP2's own collective counted (what FSDP2 calls may wrap it for the overlapped reduce-scatter).
    The only per-rank state is gradient error feedback
    (``QSDPConfig.grad_error_feedback``): :meth:`error_state` / :meth:`load_error_state`, one file per
    rank in a checkpoint. Without it a run may resume on another world size; with it the buffers
    then restart from zero, with a warning.
    """

    config: QSDPConfig
    units: list[FSDPUnit]
    plans: list[UnitPlan]
    all_gathers: list[QuantizedAllGather | CountedAllGather]
    reduce_scatters: list[QuantizedReduceScatter | CountedReduceScatter]
    seeds: SeedSchedule
    world_size: int
    replica_all_reduces: list[ReplicaAllReduce] = field(default_factory=list)
    replicas: int = 1
    reduce_scatter_overlap: ReduceScatterOverlap | None = None  # QSDPConfig.overlap_reduce_scatter
    # Per unit, the reduce-scatter's plan: the parameters that require grad (the all-gather's ``plans``
    # cover all of them); the same object as the unit's plan when none is frozen.
    grad_plans: list[UnitPlan] = field(default_factory=list)
    _hooks: list = field(default_factory=list)

    @property
    def quantized_reduce_scatters(self) -> list[QuantizedReduceScatter]:
        """The units' reduce-scatters that quantize (the ones that may keep error feedback)."""
        return [rs for rs in self.reduce_scatters if isinstance(rs, QuantizedReduceScatter)]

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
                "shard_numel": plan.numel,
                "quantized_numel": sum(n for n, q in plan.segments if q),
                # what the reduce-scatter carries: frozen parameters (adapters, LoRA) have no gradient
                "grad_shard_numel": rs.plan.numel,
                "weights_quantized": isinstance(ag, QuantizedAllGather),
                "grads_quantized": isinstance(rs, QuantizedReduceScatter),
                # what gradient error feedback holds on this rank: (P-1) chunks of the reduce-scatter
                "error_feedback_bytes": (
                    (self.world_size - 1) * rs.plan.numel * rs.error_dtype.itemsize
                    if isinstance(rs, QuantizedReduceScatter) and rs.error_dtype is not None
                    else 0
                ),
                **({"replica_grads_quantized": isinstance(ar, QuantizedReplicaAllReduce)} if ar is not None else {}),
            }
            for plan, ag, rs, ar in zip(
                self.plans, self.all_gathers, self.reduce_scatters, self.replica_all_reduces or [None] * len(self.plans), strict=True
            )
        ]

    def error_state(self) -> dict[str, torch.Tensor]:
        """This rank's error-feedback buffers, ``{"unit<index>": tensor}`` (empty without error feedback)."""
        return {f"unit{rs.plan.index}": rs.error for rs in self.quantized_reduce_scatters if rs.error is not None}

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
        for rs in self.quantized_reduce_scatters:
            rs.load_error_state(tensors.get(f"unit{rs.plan.index}"))

    def error_feedback_nbytes(self) -> int:
        """Bytes this rank holds for gradient error feedback (0 before the first step or without it)."""
        return sum(rs.error.numel() * rs.error.element_size() for rs in self.quantized_reduce_scatters if rs.error is not None)

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
        quantized = (QuantizedAllGather, QuantizedReduceScatter, QuantizedReplicaAllReduce)
        for comm in (*self.all_gathers, *self.reduce_scatters, *self.replica_all_reduces):
            if isinstance(comm, quantized):  # the stock collectives have no phases to split
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
    shared = _shared_state(units, config, default_meter if meter is None else meter, replica_group)
    plans = [_unit_plans(unit, config) for unit in units]
    # Every check runs in building the comms (refuse_unsupported): only then change the units.
    comms = [build_unit_comms(unit, plan, grad_plan, shared) for unit, (plan, grad_plan) in zip(units, plans, strict=True)]
    for unit, unit_comms in zip(units, comms, strict=True):
        unit_comms.install(unit, shared.world_size * shared.replicas)
    if config.prefetch:
        apply_prefetch(model)
    handle = QSDPHandle(
        config, units, [plan for plan, _ in plans], [c.all_gather for c in comms], [c.reduce_scatter for c in comms], shared.seeds,
        shared.world_size, [c.replica for c in comms if c.replica is not None], shared.replicas, shared.overlap,
        grad_plans=[grad_plan for _, grad_plan in plans],
    )  # fmt: skip
    for optimizer in optimizers:
        handle.attach_optimizer(optimizer)
    logger.debug("QSDP installed on %d FSDP units: %s", len(units), handle.describe())
    return handle


def _shared_state(units: list[FSDPUnit], config: QSDPConfig, meter: WireMeter, replica_group: dist.ProcessGroup | None) -> SharedComms:
    """What every unit's comms share; the replica checks run here, before any collective."""
    world_size = max(unit.world_size for unit in units)
    replicas = _check_replica_group(units, replica_group)
    owner_offset = owner = 0
    if replicas > 1:
        # The rank among all ranks of the model (replica * S + shard rank), from the shard group itself:
        # a unit without parameters (a root over the blocks) has no mesh to ask.
        owner_offset = replica_group.rank() * world_size
        owner = owner_offset + shard_group(units, "install_qsdp").rank()
    return SharedComms(
        config=config,
        seeds=SeedSchedule(config.seed),
        meter=meter,
        buffers=BufferPool(),  # one per model: units of equal size share their buffers
        # One per model: pending reduce-scatters finish in the order they started, whichever unit.
        overlap=ReduceScatterOverlap() if config.overlap_reduce_scatter else None,
        world_size=world_size,
        replica_group=replica_group if replicas > 1 else None,
        replicas=replicas,
        owner_offset=owner_offset,
        owner=owner,
    )


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
