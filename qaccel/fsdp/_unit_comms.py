"""The comms of one FSDP2 unit, built with everything they need, and installed on the unit in one place.

Per unit the installer picks a transport per direction (quantized, or FSDP2's own collective
counted), wraps them for the overlapped reduce-scatter when ``QSDPConfig.overlap_reduce_scatter``
is on, and, under hierarchical QSDP, adds the all-reduce hook across replicas. Building refuses
what QSDP cannot do right (:func:`refuse_unsupported`) before any unit is changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from .. import _torch_internals as torch_internals
from ..comm import BufferPool, WireMeter
from ._comms import CountedAllGather, CountedReduceScatter, QSDPComm, QuantizedAllGather, QuantizedReduceScatter
from ._plan import UnitPlan
from ._replica import QuantizedReplicaAllReduce, ReplicaAllReduce
from ._rs_overlap import OverlappedReduceScatter, ReduceScatterOverlap, SettlingAllGather
from ._seeds import SeedSchedule
from ._units import FSDPUnit
from .config import QSDPConfig

__all__ = ["SharedComms", "UnitComms", "build_unit_comms", "refuse_unsupported"]


@dataclass(frozen=True)
class SharedComms:
    """What the comms of every unit of one model share.

    Attributes:
        config: the QSDP settings.
        seeds: the model's seed schedule.
        meter: where bytes are recorded.
        buffers: the model's buffer pool.
        overlap: the model's pending reduce-scatters (``overlap_reduce_scatter``), or None.
        world_size: the shard group size S.
        replica_group: hierarchical QSDP's replica group (R >= 2), or None on a 1-D mesh.
        replicas: R (1 on a 1-D mesh).
        owner_offset: ``replica index * S`` (0 on a 1-D mesh).
        owner: this rank's index among all ranks of the model (``replica * S + shard rank``).
    """

    config: QSDPConfig
    seeds: SeedSchedule
    meter: WireMeter
    buffers: BufferPool
    overlap: ReduceScatterOverlap | None
    world_size: int
    replica_group: dist.ProcessGroup | None
    replicas: int
    owner_offset: int
    owner: int


@dataclass(frozen=True)
class UnitComms:
    """One unit's transports, what FSDP2 is given (the transports, or their overlap wrappers), and its replica hook.

    Attributes:
        all_gather: the all-gather transport.
        reduce_scatter: the reduce-scatter transport.
        installed_all_gather: the all-gather comm FSDP2 calls.
        installed_reduce_scatter: the reduce-scatter comm FSDP2 calls.
        replica: the all-reduce hook across replicas, or None on a 1-D mesh.
    """

    all_gather: QuantizedAllGather | CountedAllGather
    reduce_scatter: QuantizedReduceScatter | CountedReduceScatter
    installed_all_gather: QSDPComm
    installed_reduce_scatter: QSDPComm
    replica: ReplicaAllReduce | None

    def install(self, unit: FSDPUnit, data_parallel_size: int) -> None:
        """Set the comms (and the replica hook) on every module of ``unit``.

        Args:
            unit: the unit.
            data_parallel_size: ``S * R``, what FSDP2 divides the summed shard by under hierarchical QSDP.
        """
        for module in unit.modules:
            if self.reduce_scatter.needs_forced_sum or self.replica is not None:
                # SUM transport; FSDP2 divides afterwards (by P, or the user's gradient divide factor).
                module.set_force_sum_reduction_for_comms(True)
            if self.replica is not None:
                # FSDP2 on the 1-D mesh would divide by S only; the hook summed over R replicas too.
                if unit.gradient_divide_factor is None:
                    module.set_gradient_divide_factor(float(data_parallel_size))
                module.set_all_reduce_hook(self.replica)
            module.set_custom_all_gather(self.installed_all_gather)
            module.set_custom_reduce_scatter(self.installed_reduce_scatter)


def build_unit_comms(unit: FSDPUnit, plan: UnitPlan, grad_plan: UnitPlan, shared: SharedComms) -> UnitComms:
    """The comms of ``unit``; raise before anything is installed when QSDP cannot serve it.

    Args:
        unit: the unit.
        plan: its all-gather plan (every parameter).
        grad_plan: its reduce-scatter plan (the parameters that require grad).
        shared: what the model's units share.

    Raises:
        NotImplementedError: see :func:`refuse_unsupported`.
    """
    config, seeds, meter, buffers = shared.config, shared.seeds, shared.meter, shared.buffers
    weight_codec = config.weight_codec() if plan.enabled else None
    grad_codec = config.grad_codec() if grad_plan.enabled else None
    refuse_unsupported(unit, weights_quantized=weight_codec is not None, grads_quantized=grad_codec is not None)
    all_gather = CountedAllGather(meter, buffers) if weight_codec is None else QuantizedAllGather(plan, weight_codec, seeds, meter, buffers)
    reduce_scatter = (
        CountedReduceScatter(grad_plan, meter, buffers)
        if grad_codec is None
        else QuantizedReduceScatter(grad_plan, grad_codec, seeds, meter, buffers, config.error_feedback_dtype(), owner_offset=shared.owner_offset)
    )
    installed_all_gather, installed_reduce_scatter = all_gather, reduce_scatter
    if shared.overlap is not None:
        installed_all_gather = SettlingAllGather(all_gather, shared.overlap)
        # find_units refused units with several param groups: one, or none for a unit without parameters
        # (which never reduce-scatters).
        groups = torch_internals.param_groups(torch_internals.fsdp_state(unit.modules[0]))
        if groups:
            installed_reduce_scatter = OverlappedReduceScatter(reduce_scatter, shared.overlap, groups[0])
    return UnitComms(all_gather, reduce_scatter, installed_all_gather, installed_reduce_scatter, _replica_hook(grad_plan, shared))


def _replica_hook(grad_plan: UnitPlan, shared: SharedComms) -> ReplicaAllReduce | None:
    """The hook summing the reduce-scatter's output across replicas (the gradient plan's layout), or None on a 1-D mesh."""
    if shared.replica_group is None:
        return None
    codec = shared.config.replica_grad_codec() if grad_plan.enabled else None
    if codec is None:
        return ReplicaAllReduce(shared.replica_group, shared.meter)  # a unit on the stock path is small: exact
    return QuantizedReplicaAllReduce(grad_plan, codec, shared.seeds, shared.meter, shared.replica_group, shared.owner, shared.buffers)


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
