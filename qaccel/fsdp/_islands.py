"""Replicas that train apart: the per-step sync across replicas paused, so each shard group is an island (DiLoCo).

Hierarchical QSDP shards every unit on the 1-D intra-node mesh and sums each gradient shard over the
replica group in the unit's all-reduce hook; FSDP2 then divides the sum by S * R (the installer
forces SUM reductions and sets that divide factor, ``docs/qsdp.md``, "Hierarchical QSDP"). DiLoCo's
islands are the shard groups, and they must not talk between its syncs: while
:func:`replica_sync_paused` is active no unit has a hook and each divides by its factor / R, so an
island's gradient is the mean over its own S ranks (stock FSDP2's on the intra-node mesh); leaving it
puts every hook and factor back.

A model sharded on a 2-D mesh (FSDP2's native HSDP) cannot be paused: FSDP2 all-reduces across
replicas inside its reduction, and ``set_requires_all_reduce(False)`` only defers that all-reduce to
a later backward (gradient accumulation). :func:`island_units` refuses it, naming the way out.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist
from torch import nn

from .. import _torch_internals as torch_internals
from ._replica import ReplicaAllReduce
from ._units import FSDPUnit, HookOwner, check_replica_group, find_units

__all__ = ["island_units", "replica_sync_paused"]


def _refuse_2d_mesh(model: nn.Module, caller: str) -> None:
    from torch.distributed.tensor import DTensor

    meshes = {p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
    for mesh in meshes:
        if mesh.ndim != 1:
            raise ValueError(
                f"{caller}: the model is sharded on a {mesh.ndim}-D mesh {tuple(mesh.shape)} (FSDP2's native HSDP), which "
                "all-reduces gradients across replicas inside every backward and cannot leave the islands apart. Shard on "
                "the intra-node mesh: qaccel.Accelerator with a QSDPPlugin (its codecs may all be off) and "
                "ParallelismConfig(dp_replicate_size=R, dp_shard_size=S), or fully_shard(..., mesh=mesh['shard']) and "
                "the replica group mesh['replicate'].get_group()"
            )


def island_units(model: nn.Module, replica_group: dist.ProcessGroup | None, caller: str) -> tuple[list[FSDPUnit], dist.ProcessGroup]:
    """``model``'s FSDP2 units and the replica group joining their islands, once the shard groups can be islands.

    Args:
        model: the FSDP2 model.
        replica_group: the ranks holding this rank's shard in the other islands; None: the group hierarchical
            QSDP's hooks sum over.
        caller: the public class or function checking, for messages.

    Raises:
        ValueError: the model is sharded on a 2-D mesh; or on one mesh with no replica group (its ranks hold
            pieces of one model); ``replica_group`` does not pair this rank's shard mesh with one rank of
            every other island (:func:`check_replica_group`); or a unit's all-reduce hook belongs to
            something other than hierarchical QSDP (a sharded 1-bit optimizer, a user's hook).
    """
    _refuse_2d_mesh(model, caller)
    units = find_units(model)
    for unit in units:
        if unit.all_reduce_hook_owner not in (None, HookOwner.HIERARCHICAL_QSDP):
            raise ValueError(
                f"{caller}: FSDP unit {unit.name} has an all-reduce hook of {unit.all_reduce_hook_owner.value} "
                f"({unit.all_reduce_hook}), which talks across replicas every step; islands sync only at the outer "
                "step. Use a plain inner optimizer (e.g. torch.optim.AdamW) and no other all-reduce hook"
            )
    group = _hook_replica_group(units) if replica_group is None else replica_group
    if group is None:
        ranks = max((unit.world_size for unit in units), default=1)
        raise ValueError(
            f"{caller}: the model is sharded with FSDP2 over one mesh of {ranks} ranks and has no replica group: its "
            "ranks hold pieces of one model, not islands. Give the run islands: ParallelismConfig(dp_replicate_size=R, "
            "dp_shard_size=S) with a QSDPPlugin (R islands of S ranks), DDP (every rank an island), or "
            f"{caller}(replica_group=...) for a model sharded on an intra-node mesh by hand"
        )
    check_replica_group(units, group, caller)
    return units, group


def _unit_hooks(unit: FSDPUnit) -> list[object | None]:
    groups = torch_internals.param_groups(torch_internals.fsdp_state(unit.modules[0]))
    return [torch_internals.group_all_reduce_hook(group) for group in groups]


def _hook_replica_group(units: list[FSDPUnit]) -> dist.ProcessGroup | None:
    """The replica group hierarchical QSDP's hooks sum over, or None when no unit has one."""
    for unit in units:
        for hook in _unit_hooks(unit):
            if isinstance(hook, ReplicaAllReduce):
                return hook.group
    return None


@contextmanager
def replica_sync_paused(units: list[FSDPUnit], replicas: int) -> Iterator[None]:
    """While active, the units' gradients are summed within the shard group only (no replica hook), and averaged there.

    Args:
        units: the model's units (:func:`island_units`).
        replicas: R, the size of the replica group the hooks sum over.
    """
    paused = []
    for unit in units:
        hooks = [hook for hook in _unit_hooks(unit) if hook is not None]
        if not hooks:
            continue  # no replica all-reduce: the unit already averages within its shard group
        factor = unit.gradient_divide_factor  # S * R, set by the installer (or the user's own)
        paused.append((unit, hooks[0], factor))
        for module in unit.modules:
            module.set_all_reduce_hook(None)
            if factor is not None:
                module.set_gradient_divide_factor(factor / replicas)
    try:
        yield
    finally:
        for unit, hook, factor in paused:
            for module in unit.modules:
                module.set_all_reduce_hook(hook)
                if factor is not None:
                    module.set_gradient_divide_factor(factor)
