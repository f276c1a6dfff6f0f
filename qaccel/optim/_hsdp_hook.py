"""0/1 Adam and 1-bit Adam on HSDP shards: FSDP2's all-reduce hook across replicas, gated by the comm plan.

HSDP shards a model within a node (S ranks) and replicates it across nodes (R replicas). Each FSDP2
unit is sharded on the 1-D intra-node mesh and reduce-scatters its gradient there (stock FSDP2 or
QSDP's quantized reduce-scatter); :class:`OneBitReplicaHook` is the unit's all-reduce hook
(``FSDPModule.set_all_reduce_hook``), which FSDP2 calls with the node's summed gradient shard. On the
optimizer's FULL steps (variance and warm-up steps) it averages that shard across the replicas in
full precision; on every other step it leaves it alone, and the optimizer, working on the local
shards, compresses the momentum (or the gradient) across replicas itself, or sends nothing (0/1 Adam's
local steps). This is the DDP hook's job (:mod:`qaccel.optim._ddp_hook`) one level up
(``docs/zero_one_adam.md``, "Sharded parameters (HSDP)").

Averaging order: the hook divides the shard by R and sums over the replicas (DDP's order,
``allreduce_hook``), then FSDP2 divides by S. With S = 1 this is DDP's computation: the trajectory
equals DDP 0/1 Adam's bit for bit with two replicas, and with more up to the order in which the
all-reduce sums an element (gloo's ring order depends on the element's position in the buffer, and
DDP's buckets are laid out unlike FSDP2's units).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..comm import WireMeter, ring_all_reduce_bytes
from ..fsdp import KIND_REPLICA_AR, AllReduceHook, FSDPUnit, HookOwner, check_replica_group, find_units
from ._base import OneBitOptimizerBase
from ._port import OneBitPlacement
from ._schedule import CommPlan
from ._units import is_sharded

__all__ = ["OneBitReplicaHook", "register_hsdp_comm_hook"]


class OneBitReplicaHook(AllReduceHook):
    """``FSDPModule.set_all_reduce_hook`` callable: average a gradient shard across replicas on FULL steps only.

    Args:
        plan: the optimizer's comm plan (fixed at the end of the previous optimizer step).
        group: the replica process group.
        meter: where the full-precision all-reduce is recorded (kind ``hsdp.replica_all_reduce``).
    """

    hook_owner = HookOwner.ONEBIT_OPTIMIZER

    def __init__(self, plan: CommPlan, group: dist.ProcessGroup, meter: WireMeter) -> None:
        self.plan = plan
        self.group = group
        self.meter = meter

    def __call__(self, reduce_output: torch.Tensor) -> None:
        if not self.plan.full_allreduce_next:
            return  # the optimizer compresses this step's shard across replicas, or keeps it local
        replicas = self.group.size()
        nbytes = ring_all_reduce_bytes(reduce_output.numel() * reduce_output.element_size(), replicas)
        self.meter.record(KIND_REPLICA_AR, sent_bytes=nbytes, recv_bytes=nbytes)
        reduce_output.div_(replicas)
        dist.all_reduce(reduce_output, op=dist.ReduceOp.SUM, group=self.group)

    def __repr__(self) -> str:
        return f"OneBitReplicaHook(replicas={self.group.size()})"


def register_hsdp_comm_hook(
    model: nn.Module,
    optimizer: OneBitOptimizerBase,
    *,
    replica_group: dist.ProcessGroup,
    wire_meter: WireMeter | None = None,
) -> OneBitReplicaHook:
    """Run ``optimizer`` (0/1 Adam or 1-bit Adam) on the shards of an HSDP model, compressing across replicas.

    ``model``'s units must be sharded with ``fully_shard`` on the 1-D intra-node mesh (not the 2-D
    HSDP mesh: FSDP2 would then all-reduce every step across nodes itself). Every unit gets
    :class:`OneBitReplicaHook`, SUM reductions and a gradient divide factor of S (the hook divides by R
    when it averages; a divide factor the user set is kept). The optimizer is attached to a
    :class:`~qaccel.optim.OneBitPlacement` of the replica group (its 1-bit all-reduce, replica checks)
    and the shard group (gradient norms). QSDP's intra-node
    codecs may be installed as well, with :func:`qaccel.fsdp.install_qsdp` *without* ``replica_group``.

    ``qaccel.Accelerator.prepare`` calls this for a 1-bit optimizer under
    ``ParallelismConfig(dp_replicate_size=R, dp_shard_size=S)`` and a ``QSDPPlugin``.

    Args:
        model: the FSDP2 model holding the optimizer's parameters.
        optimizer: a :class:`~qaccel.optim.ZeroOneAdam` or :class:`~qaccel.optim.OneBitAdam` built on
            ``model.parameters()`` (after ``fully_shard``).
        replica_group: the ranks that hold this rank's shard on the other nodes
            (``mesh["replicate"].get_group()`` of the 2-D mesh whose ``"shard"`` dimension sharded the model).
        wire_meter: where bytes are recorded (default: the optimizer's).

    Returns:
        The hook (one object, shared by every unit).

    Raises:
        TypeError: ``optimizer`` is not a qaccel 1-bit optimizer.
        ValueError: ``model`` has no FSDP2 unit, a unit already has another all-reduce hook (hierarchical
            QSDP's included), some optimizer parameter is not one of the model's sharded parameters, or
            ``replica_group`` does not pair this rank's shard mesh with one rank per node.
        NotImplementedError: the model was sharded on a 2-D (native HSDP) mesh.
        RuntimeError: the optimizer already runs on other groups or another meter.

    Example::

        mesh = init_device_mesh("cuda", (R, S), mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        optimizer = ZeroOneAdam(model.parameters(), lr=1e-3, var_freeze_step=1000)
        register_hsdp_comm_hook(model, optimizer, replica_group=mesh["replicate"].get_group())
    """
    if not isinstance(optimizer, OneBitOptimizerBase):
        raise TypeError(f"register_hsdp_comm_hook: expected ZeroOneAdam or OneBitAdam, got {type(optimizer).__name__}")
    units = _checked_units(model, optimizer)
    check_replica_group(units, replica_group, "register_hsdp_comm_hook")
    shard_mesh = next(unit.params[0].device_mesh for unit in units if unit.params)
    shard_ranks = max(unit.world_size for unit in units)
    placement = OneBitPlacement(
        process_group=replica_group,
        shard_group=shard_mesh.get_group(),
        wire_meter=optimizer.wire_meter if wire_meter is None else wire_meter,
    )
    # Every check passed: only now change the optimizer (which refuses another placement) and the units.
    optimizer.attach(placement)
    hook = OneBitReplicaHook(optimizer.comm_plan, replica_group, placement.wire_meter)
    for unit in units:
        for module in unit.modules:
            module.set_force_sum_reduction_for_comms(True)
            if unit.gradient_divide_factor is None:
                module.set_gradient_divide_factor(float(shard_ranks))
            module.set_all_reduce_hook(hook)
    return hook


def _checked_units(model: nn.Module, optimizer: OneBitOptimizerBase) -> list[FSDPUnit]:
    """``model``'s FSDP2 units, once none has a foreign all-reduce hook and they shard every optimizer parameter."""
    units = find_units(model)
    if not units:
        raise ValueError(
            f"register_hsdp_comm_hook: {type(model).__name__} has no FSDP2 unit; call fully_shard on the intra-node mesh first"
        )
    taken = [
        (unit.name, unit.all_reduce_hook, unit.all_reduce_hook_owner)
        for unit in units
        if unit.all_reduce_hook_owner not in (None, HookOwner.ONEBIT_OPTIMIZER)
    ]
    if taken:
        name, hook, owner = taken[0]
        advice = (
            "hierarchical QSDP's replica all-reduce is installed: with a 1-bit optimizer, install QSDP without "
            "replica_group (the optimizer owns the traffic across replicas)"
            if owner is HookOwner.HIERARCHICAL_QSDP
            else "remove it"
        )
        raise ValueError(f"register_hsdp_comm_hook: FSDP unit {name} already has an all-reduce hook ({hook}); {advice}")
    sharded = {id(p) for unit in units for p in unit.params}
    strangers = [
        index
        for index, p in enumerate(p for group in optimizer.param_groups for p in group["params"])
        if p.requires_grad and (id(p) not in sharded or not is_sharded(p))
    ]
    if strangers:
        raise ValueError(
            f"register_hsdp_comm_hook: optimizer parameters {strangers[:8]} (in param-group order) are not sharded "
            f"parameters of {type(model).__name__}; build the optimizer on model.parameters() after fully_shard"
        )
    return units
