"""FSDP2 units of a model and the segment map of their flat communication buffers.

A unit's module list, param groups, per-parameter all-gather dtypes and post-forward mesh live in
FSDP2's private ``FSDPState`` / ``FSDPParamGroup`` / ``FSDPParam`` (``docs/qsdp.md``, "Upstream hook
points"); they are read through :mod:`qaccel._torch_internals`, which names the torch versions it was
checked against and fails with that message when an attribute is gone.

Segment map (``docs/qsdp.md``, "Segment map"): FSDP2's all-gather input of a unit is its parameters' shards, in the
order ``fully_shard`` collected them (post-order DFS from the unit's modules, not entering nested
units, each parameter once), each padded to ``ceil(dim0 / P) * prod(rest)`` elements. The
reduce-scatter chunk for one rank has the same layout over the parameters that require grad
(frozen ones, e.g. a LoRA base, have no gradient to send: ``FSDPUnit.trainable``). The map is
checked against the real buffer length at the first call; on a mismatch the comm warns once and
uses uniform buckets.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DeviceMesh, DTensor

from .. import _torch_internals as torch_internals
from ._comms import QSDPComm
from ._plan import padded_shard_numel

__all__ = [
    "AllReduceHook",
    "FSDPUnit",
    "HookOwner",
    "find_units",
    "check_replica_group",
    "require_custom_comms",
    "shard_group",
]


class HookOwner(enum.Enum):
    """Who installed a unit's ``set_all_reduce_hook`` callable: FSDP2 keeps one per unit, so two owners cannot share it."""

    HIERARCHICAL_QSDP = "hierarchical QSDP's replica all-reduce"
    ONEBIT_OPTIMIZER = "a sharded 1-bit optimizer"
    OTHER = "a hook qaccel did not install"


class AllReduceHook:
    """Base of qaccel's all-reduce hooks: ``hook_owner`` says which feature installed it (identity by type, not by name)."""

    hook_owner: ClassVar[HookOwner]


def require_custom_comms() -> None:
    """Raise unless this torch lets FSDP2 units take custom all-gather / reduce-scatter comms."""
    torch_internals.fsdp2_comm_bases()
    if not hasattr(FSDPModule, "set_custom_all_gather"):
        raise RuntimeError(
            f"QSDP needs FSDP2 custom comms (FSDPModule.set_custom_all_gather, torch >= 2.9); "
            f"this is torch {torch.__version__}"
        )


@dataclass
class FSDPUnit:
    """One FSDP2 communication unit (one ``fully_shard`` call).

    Attributes:
        index: position among the model's units in ``model.modules()`` order (same on all ranks).
        modules: the FSDPModules that share this unit's state (list-form ``fully_shard``).
        params: the unit's sharded parameters in all-gather buffer order.
        world_size: size of the unit's 1-D shard mesh.
        name: qualified name of the first module, for messages.
        all_gather_dtypes: per parameter, the dtype FSDP2 all-gathers it in (``param_dtype`` of
            the mixed-precision policy, else the parameter's own dtype). When they differ, FSDP2
            gathers one uint8 byte buffer instead of the elements.
        reshard_after_forward_size: the group size given as ``reshard_after_forward=<int>``, or
            ``None`` for a bool (the post-forward shards are then the regular ones, or none).
        custom_extension: names of parameters whose local tensor defines ``fsdp_pre_all_gather``
            (tensor-subclass all-gather extensions: the all-gather input is not the shard).
        param_names: qualified names of ``params`` in the model, for messages.
        all_reduce_hook: the type name of the hook installed with ``FSDPModule.set_all_reduce_hook``,
            for messages, or None.
        all_reduce_hook_owner: who installed that hook (:class:`HookOwner`), or None without one.
        gradient_divide_factor: the factor set with ``set_gradient_divide_factor``, or None.
    """

    index: int
    modules: tuple[nn.Module, ...]
    params: list[nn.Parameter]
    world_size: int
    name: str
    all_gather_dtypes: tuple[torch.dtype, ...] = ()
    reshard_after_forward_size: int | None = None
    custom_extension: tuple[str, ...] = ()
    param_names: tuple[str, ...] = ()
    all_reduce_hook: str | None = None
    all_reduce_hook_owner: HookOwner | None = None
    gradient_divide_factor: float | None = None

    def shard_numels(self) -> list[int]:
        return [padded_shard_numel(p.shape, self.world_size) for p in self.params]

    def trainable(self) -> list[bool]:
        """Per parameter, whether it requires grad: FSDP2 reduce-scatters only those parameters' gradients."""
        return [p.requires_grad for p in self.params]


def _managed_params(roots: tuple[nn.Module, ...]) -> list[nn.Parameter]:
    """Mirror of FSDP2's ``_get_managed_modules`` + ``_get_managed_states`` (post-order DFS)."""
    root_set = set(roots)
    visited: set[nn.Module] = set()
    ordered: list[nn.Module] = []

    def dfs(module: nn.Module) -> None:
        if module not in root_set and isinstance(module, FSDPModule):
            return  # a nested unit owns its own parameters
        visited.add(module)
        for child in module.children():
            if child not in visited:
                dfs(child)
        ordered.append(module)

    for root in roots:
        dfs(root)
    params: list[nn.Parameter] = []
    seen: set[int] = set()
    for module in ordered:
        for param in module.parameters(recurse=False):
            # Ignored parameters stay plain tensors; only DTensors are in the FSDP buffer.
            if id(param) not in seen and isinstance(param, DTensor):
                seen.add(id(param))
                params.append(param)
    return params


def find_units(model: nn.Module) -> list[FSDPUnit]:
    """List the model's FSDP2 units and refuse what QSDP v1 cannot handle.

    Raises:
        NotImplementedError: for HSDP / 2-D meshes (the replica all-reduce cannot be replaced) and
            for units with several param groups (``shard_placement_fn`` with per-param meshes).
        ValueError: when a unit already carries another custom comm.
    """
    units: list[FSDPUnit] = []
    by_state: dict[int, FSDPUnit] = {}
    names = {id(param): name for name, param in model.named_parameters(remove_duplicate=False)}
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        state = torch_internals.fsdp_state(module)
        if id(state) in by_state:
            unit = by_state[id(state)]
            unit.modules = (*unit.modules, module)
            continue
        groups = torch_internals.param_groups(state)
        if len(groups) > 1:
            raise NotImplementedError(
                f"QSDP: FSDP unit {name or '<root>'} has {len(groups)} param groups (per-parameter meshes "
                "via shard_placement_fn); QSDP supports one group per unit"
            )
        params = _managed_params(torch_internals.state_modules(state))
        meshes = {p.device_mesh for p in params}
        for mesh in meshes:
            if mesh.ndim != 1:
                raise NotImplementedError(
                    f"QSDP: FSDP unit {name or '<root>'} is sharded on a {mesh.ndim}-D mesh {tuple(mesh.shape)}; "
                    "its replica all-reduce cannot be replaced. For HSDP use hierarchical QSDP: shard on the 1-D intra-node "
                    "mesh and pass install_qsdp(..., replica_group=...) (docs/qsdp.md, 'Hierarchical QSDP')"
                )
        _refuse_foreign_comms(name or "<root>", groups)
        world_size = next(iter(meshes)).size() if meshes else 1
        hook = _all_reduce_hook(groups)
        unit = FSDPUnit(
            index=len(units),
            modules=(module,),
            params=params,
            world_size=world_size,
            name=name or "<root>",
            all_gather_dtypes=_all_gather_dtypes(groups),
            reshard_after_forward_size=_reshard_after_forward_size(groups),
            custom_extension=_custom_extension_params(groups, names),
            param_names=tuple(names.get(id(param), "?") for param in params),
            all_reduce_hook=None if hook is None else type(hook).__name__,
            all_reduce_hook_owner=_owner(hook),
            gradient_divide_factor=next((f for f in map(torch_internals.group_gradient_divide_factor, groups) if f is not None), None),
        )
        units.append(unit)
        by_state[id(state)] = unit
    return units


def _refuse_foreign_comms(name: str, groups: list) -> None:
    """Raise ValueError when a unit carries a comm that is neither FSDP2's default nor QSDP's (a re-install)."""
    ours = (*torch_internals.fsdp2_default_comm_types(), QSDPComm)
    for group in groups:
        for attr, comm in torch_internals.installed_comms(group).items():
            if comm is not None and not isinstance(comm, ours):
                raise ValueError(
                    f"QSDP: FSDP unit {name} already has a custom comm {type(comm).__name__} "
                    f"({attr}); do not combine QSDP with set_allocate_memory_from_process_group_for_comm "
                    "or symmetric-memory comms"
                )


def _shard_mesh(units: list[FSDPUnit], caller: str) -> DeviceMesh:
    meshes = {unit.params[0].device_mesh for unit in units if unit.params}
    if len(meshes) != 1:
        raise ValueError(f"{caller}(replica_group=...): the units are sharded on {len(meshes)} different meshes; one intra-node mesh is needed")
    return next(iter(meshes))


def shard_group(units: list[FSDPUnit], caller: str) -> dist.ProcessGroup:
    """The process group of the one 1-D mesh ``units`` are sharded on (units without parameters have none).

    Raises:
        ValueError: the units are sharded on several meshes, or none holds a parameter.
    """
    return _shard_mesh(units, caller).get_group()


def check_replica_group(units: list[FSDPUnit], replica_group: dist.ProcessGroup, caller: str) -> int:
    """The replica count R; raise ValueError when ``replica_group`` cannot be the replicas of this rank's shard.

    Local checks only (no collective): every unit is sharded on the same 1-D mesh of S ranks, the
    replica group contains this rank and meets that mesh in this rank alone, and S * R is the world.

    Args:
        units: the model's FSDP2 units (:func:`find_units`).
        replica_group: the ranks that hold this rank's shard on the other nodes.
        caller: the public function checking (``install_qsdp``, ``register_hsdp_comm_hook``), for messages.
    """
    shard_ranks = set(_shard_mesh(units, caller).mesh.flatten().tolist())
    replica_ranks = set(dist.get_process_group_ranks(replica_group))
    me, replicas, world = dist.get_rank(), len(replica_ranks), dist.get_world_size()
    if me not in replica_ranks or shard_ranks & replica_ranks != {me} or len(shard_ranks) * replicas != world:
        raise ValueError(
            f"{caller}(replica_group=...): rank {me}'s shard mesh has ranks {sorted(shard_ranks)} and the replica group "
            f"{sorted(replica_ranks)} (world size {world}); the replica group must hold this rank and one rank of every other "
            "node, and (shard size) x (replicas) must be the world size. Build both from one 2-D mesh: "
            "mesh = init_device_mesh(device, (R, S), mesh_dim_names=('replicate', 'shard')); fully_shard(..., "
            f"mesh=mesh['shard']); {caller}(..., replica_group=mesh['replicate'].get_group())"
        )
    return replicas


def _all_reduce_hook(groups: list) -> object | None:
    for group in groups:
        hook = torch_internals.group_all_reduce_hook(group)
        if hook is not None:
            return hook
    return None


def _owner(hook: object | None) -> HookOwner | None:
    if hook is None:
        return None
    return hook.hook_owner if isinstance(hook, AllReduceHook) else HookOwner.OTHER


def _all_gather_dtypes(groups: list) -> tuple[torch.dtype, ...]:
    """The dtype FSDP2 all-gathers each parameter in, known before its lazy init has run.

    Mirror of ``FSDPParam.init_dtype_attrs`` (run at the first forward): a floating-point
    parameter is cast to the policy's ``param_dtype`` when one is set, others keep their dtype.
    """
    dtypes = []
    for group in groups:
        policy_dtype = torch_internals.group_param_dtype(group)
        for fsdp_param in torch_internals.group_params(group):
            own = torch_internals.sharded_param(fsdp_param).dtype
            dtypes.append(policy_dtype if policy_dtype is not None and own.is_floating_point else own)
    return tuple(dtypes)


def _reshard_after_forward_size(groups: list) -> int | None:
    """``reshard_after_forward=<int>`` gives a post-forward mesh other than the unit's own mesh."""
    for group in groups:
        size = torch_internals.group_post_forward_mesh_size(group)
        if size is not None:
            return size
    return None


def _custom_extension_params(groups: list, names: dict[int, str]) -> tuple[str, ...]:
    found = []
    for group in groups:
        for fsdp_param in torch_internals.group_params(group):
            local = torch_internals.sharded_local_tensor(fsdp_param)
            if hasattr(local, "fsdp_pre_all_gather"):
                found.append(names.get(id(torch_internals.sharded_param(fsdp_param)), type(local).__name__))
    return tuple(found)
