"""FSDP2 units of a model and the segment map of their flat communication buffers.

This is the one module that reads FSDP2 internals (``shared/design/qsdp.md`` section 5.1): the
comm base classes live in ``torch.distributed.fsdp._fully_shard._fsdp_api`` and a unit's module
list and param groups in its private ``FSDPState``. Each access is feature-detected.

Segment map (section 7): FSDP2's all-gather input of a unit is its parameters' shards, in the
order ``fully_shard`` collected them (post-order DFS from the unit's modules, not entering nested
units, each parameter once), each padded to ``ceil(dim0 / P) * prod(rest)`` elements. The
reduce-scatter chunk for one rank has the same layout. The map is checked against the real
buffer length at the first call; on a mismatch the comm warns once and uses uniform buckets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover - torch without custom comms (< 2.9)
    AllGather = ReduceScatter = None  # type: ignore[assignment,misc]

__all__ = ["AllGather", "ReduceScatter", "FSDPUnit", "find_units", "padded_shard_numel", "require_custom_comms"]


def require_custom_comms() -> None:
    """Raise unless this torch lets FSDP2 units take custom all-gather / reduce-scatter comms."""
    if AllGather is None or not hasattr(FSDPModule, "set_custom_all_gather"):
        raise RuntimeError(
            f"QSDP needs FSDP2 custom comms (FSDPModule.set_custom_all_gather, torch >= 2.9); "
            f"this is torch {torch.__version__}"
        )


def padded_shard_numel(shape: torch.Size, world_size: int) -> int:
    """Elements of one rank's padded dim-0 shard of a parameter of ``shape``."""
    if len(shape) == 0:
        return 1
    return math.ceil(shape[0] / world_size) * math.prod(shape[1:])


@dataclass
class FSDPUnit:
    """One FSDP2 communication unit (one ``fully_shard`` call).

    Attributes:
        index: position among the model's units in ``model.modules()`` order (same on all ranks).
        modules: the FSDPModules that share this unit's state (list-form ``fully_shard``).
        params: the unit's sharded parameters in all-gather buffer order.
        world_size: size of the unit's 1-D shard mesh.
        name: qualified name of the first module, for messages.
    """

    index: int
    modules: tuple[nn.Module, ...]
    params: list[nn.Parameter]
    world_size: int
    name: str

    def shard_numels(self) -> list[int]:
        return [padded_shard_numel(p.shape, self.world_size) for p in self.params]


def _state_of(module: nn.Module):
    return module._get_fsdp_state()


def _roots_of(state, module: nn.Module) -> tuple[nn.Module, ...]:
    return tuple(getattr(state, "_modules", (module,)))


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
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        state = _state_of(module)
        if id(state) in by_state:
            unit = by_state[id(state)]
            unit.modules = (*unit.modules, module)
            continue
        groups = list(getattr(state, "_fsdp_param_groups", []))
        if len(groups) > 1:
            raise NotImplementedError(
                f"QSDP: FSDP unit {name or '<root>'} has {len(groups)} param groups (per-parameter meshes "
                "via shard_placement_fn); QSDP supports one group per unit"
            )
        params = _managed_params(_roots_of(state, module))
        meshes = {p.device_mesh for p in params}
        for mesh in meshes:
            if mesh.ndim != 1:
                raise NotImplementedError(
                    f"QSDP: FSDP unit {name or '<root>'} is sharded on a {mesh.ndim}-D mesh {tuple(mesh.shape)}; "
                    "HSDP / 2-D meshes are not supported (their replica all-reduce cannot be replaced), use a 1-D mesh"
                )
        for group in groups:
            for attr in ("_all_gather_comm", "_reduce_scatter_comm"):
                comm = getattr(group, attr, None)
                if comm is not None and not type(comm).__name__.startswith(("Default", "Quantized")):
                    raise ValueError(
                        f"QSDP: FSDP unit {name or '<root>'} already has a custom comm {type(comm).__name__} "
                        f"({attr}); do not combine QSDP with set_allocate_memory_from_process_group_for_comm "
                        "or symmetric-memory comms"
                    )
        world_size = next(iter(meshes)).size() if meshes else 1
        unit = FSDPUnit(index=len(units), modules=(module,), params=params, world_size=world_size, name=name or "<root>")
        units.append(unit)
        by_state[id(state)] = unit
    return units
