"""Optimizer units: what one compressed all-reduce covers, and their fp32 working tensors.

``granularity="tensor"``: one unit per parameter; state has the parameter's shape (DeepSpeed fp32).
``granularity="group"``: one unit per param group; state is one flat fp32 buffer over the group's
parameters in order, and missing gradients count as zeros (DeepSpeed fp16's flat master groups).

The working weights of a unit are fp32. An fp32 parameter in tensor mode is updated in place; fp32
parameters of a flat unit are gathered into a temporary flat buffer for the step and copied back; a unit
with bf16/fp16 parameters keeps ``master_weights`` in fp32 state (identical on all ranks except between
0/1 Adam syncs) and writes them back, rounded, after every step.

FSDP2 parameters are ``DTensor``s: a unit then covers this rank's shard (``DTensor.to_local()``) and
its gradient's shard, never the global tensor (``docs/zero_one_adam.md``, "Sharded parameters
(HSDP)"). The local tensor is looked up at every use: FSDP2 may rebind it (after loading a state
dict, for instance).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from .._torch_internals import dtensor_global_offset

__all__ = [
    "Unit",
    "build_units",
    "local_tensor",
    "is_sharded",
    "unit_grad",
    "unit_weights",
    "write_back",
    "unit_mask",
    "unit_params_as_weights",
]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a ``DTensor``, ``t`` itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``DTensor`` (an FSDP2 parameter), whose optimizer state covers its local shard."""
    return isinstance(t, DTensor)


@dataclass(frozen=True, eq=False)
class Unit:
    """One unit of optimizer state (hashable by identity).

    Attributes:
        group_index: index of its param group.
        params: the parameters it covers (one in tensor mode); their local shards when they are DTensors.
        numel: total elements (of the local shards).
        shape: shape of its state tensors (the parameter's local shape, or ``(numel,)`` when flat).
        is_flat: group mode.
        needs_master: the fp32 working weights live in state (some parameter is not fp32).
    """

    group_index: int
    params: tuple[torch.Tensor, ...]
    numel: int
    shape: torch.Size
    is_flat: bool
    needs_master: bool

    @property
    def anchor(self) -> torch.Tensor:
        """The parameter whose ``optimizer.state`` entry holds this unit's state."""
        return self.params[0]

    def tensors(self) -> list[torch.Tensor]:
        """What the optimizer reads and writes: each parameter, or its local shard."""
        return [local_tensor(p) for p in self.params]


def build_units(param_groups: list[dict], granularity: str) -> list[Unit]:
    """Units of ``param_groups``; parameters with ``requires_grad=False`` are left out."""
    units = []
    for index, group in enumerate(param_groups):
        params = [p for p in group["params"] if p.requires_grad]
        if not params:
            continue
        if granularity == "tensor":
            for p in params:
                local = local_tensor(p)
                units.append(Unit(index, (p,), local.numel(), local.shape, False, p.dtype != torch.float32))
        else:
            numel = sum(local_tensor(p).numel() for p in params)
            needs_master = any(p.dtype != torch.float32 for p in params)
            units.append(Unit(index, tuple(params), numel, torch.Size((numel,)), True, needs_master))
    return units


def unit_grad(unit: Unit, zeros_if_missing: bool) -> torch.Tensor | None:
    """The unit's gradient in fp32 (a read-only view for fp32 tensor units), or None if it has none.

    Args:
        zeros_if_missing: return zeros for a missing gradient instead of None (used on steps whose
            collective every rank must join, and always for flat units, as DeepSpeed's fp16 groups do).
    """
    if not unit.is_flat:
        grad = unit.anchor.grad
        grad = None if grad is None else local_tensor(grad)
        if grad is None:
            return torch.zeros(unit.shape, dtype=torch.float32, device=unit.anchor.device) if zeros_if_missing else None
        if grad.is_sparse:
            raise RuntimeError("0/1 Adam and 1-bit Adam do not support sparse gradients")
        return grad if grad.dtype == torch.float32 else grad.float()
    if all(p.grad is None for p in unit.params) and not zeros_if_missing:
        return None
    pieces = []
    for p, local in zip(unit.params, unit.tensors(), strict=True):
        if p.grad is not None and p.grad.is_sparse:
            raise RuntimeError("0/1 Adam and 1-bit Adam do not support sparse gradients")
        pieces.append(
            local_tensor(p.grad).reshape(-1).float()
            if p.grad is not None
            else torch.zeros(local.numel(), dtype=torch.float32, device=local.device)
        )
    return torch.cat(pieces)


def unit_params_as_weights(unit: Unit) -> torch.Tensor:
    """A new fp32 tensor of the unit's shape holding its parameters' current values."""
    if not unit.is_flat:
        return local_tensor(unit.anchor).detach().to(torch.float32, copy=True)
    return torch.cat([t.detach().reshape(-1).float() for t in unit.tensors()])


def unit_weights(unit: Unit, state: dict) -> torch.Tensor:
    """The fp32 working weights for one step.

    The parameter itself (fp32 tensor unit), ``state["master_weights"]`` (non-fp32 parameters), or a
    temporary flat copy of fp32 parameters (flat unit). Pass it to :func:`write_back` after updating it.
    """
    if unit.needs_master:
        return state["master_weights"]
    if not unit.is_flat:
        return local_tensor(unit.anchor)
    return unit_params_as_weights(unit)


def write_back(unit: Unit, weights: torch.Tensor) -> None:
    """Copy the working weights into the parameters (rounded to their dtype); no-op if they are the param."""
    if not unit.is_flat:
        target = local_tensor(unit.anchor)
        if weights is not target:
            target.copy_(weights)
        return
    offset = 0
    for t in unit.tensors():
        t.copy_(weights[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()


def unit_mask(unit: Unit, group: dict) -> torch.Tensor | None:
    """The group's ``exp_avg_mask`` as fp32 of the unit's shape on its device, or None.

    The mask covers the whole parameter; a sharded unit takes the rows of its shard.
    """
    mask = group.get("exp_avg_mask")
    if mask is None:
        return None
    anchor = unit.anchor
    if is_sharded(anchor):
        offsets = dtensor_global_offset(anchor)
        shard = tuple(slice(o, o + n) for o, n in zip(offsets, local_tensor(anchor).shape, strict=True))
        mask = mask.reshape(anchor.shape)[shard]
    return mask.to(device=anchor.device, dtype=torch.float32).reshape(unit.shape)
