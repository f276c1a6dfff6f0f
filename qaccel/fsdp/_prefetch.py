"""Overlap all-gathers with compute: FSDP2 explicit prefetching plus asynchronous unshards.

FSDP2 overlaps on CUDA through streams, but a CPU (gloo) run only overlaps when a collective is
issued with ``async_op=True`` and waited on later. :func:`apply_prefetch` sets both halves on a
stock or QSDP-equipped FSDP2 model (``docs/qsdp.md``, "Overlap"):

- every unit prefetches the next unit's all-gather in forward and the previous one's in backward
  (``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``), in the order the
  units appear in ``model.modules()`` (the forward order of a stack of transformer blocks);
- every unit's unshard is asynchronous (FSDP2's ``unshard_async_op``), so a prefetched all-gather
  returns a work object at once, and FSDP2 waits on it only when the unit's forward needs it.

The prefetched all-gathers use the seeds of the step they belong to, so QSDP results are
bit-identical with and without prefetch. Reduce-scatters are not this module's concern: FSDP2 uses
the reduced shard right after the call, so on CPU the QSDP comm overlaps them by itself
(:mod:`qaccel.fsdp._rs_overlap`, ``QSDPConfig.overlap_reduce_scatter``); a stock FSDP2 model keeps
its synchronous CPU reduce-scatter (on CUDA it is ordered in FSDP2's reduce-scatter stream and
overlaps the next unit's backward anyway).
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.fsdp import FSDPModule

from .. import _torch_internals as torch_internals

__all__ = ["apply_prefetch", "clear_prefetch"]

logger = logging.getLogger(__name__)


def _unit_modules(model: nn.Module) -> list[FSDPModule]:
    """One FSDP module per FSDP state (a unit may span several modules), in ``modules()`` order."""
    seen: set[int] = set()
    units: list[FSDPModule] = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = torch_internals.fsdp_state(module)
            if id(state) not in seen:
                seen.add(id(state))
                units.append(module)
    return units


def _set_async_unshard(unit: FSDPModule, enabled: bool) -> None:
    # FSDP2's own setter recurses into submodules, which would also touch units the caller did not
    # list; set the flag on this unit's own param groups only.
    for group in torch_internals.param_groups(torch_internals.fsdp_state(unit)):
        torch_internals.set_unshard_async_op(group, enabled)


def apply_prefetch(model: nn.Module, *, depth: int = 1) -> int:
    """Prefetch the next ``depth`` units' all-gathers in forward and backward, asynchronously.

    Args:
        model: an FSDP2 model (``fully_shard`` applied to its blocks and root), with or without
            QSDP comms installed.
        depth: how many units ahead to prefetch; 1 overlaps one all-gather with one unit's
            compute and keeps one extra unit's unsharded weights alive.

    Returns:
        The number of units given a prefetch target (0 for a model with a single unit).

    Raises:
        ValueError: ``model`` has no FSDP2 unit, or ``depth`` < 1.
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"apply_prefetch: depth={depth!r}: must be an int >= 1")
    units = _unit_modules(model)
    if not units:
        raise ValueError(f"apply_prefetch: {type(model).__name__} has no FSDP2 unit; call fully_shard first")
    root, blocks = units[0], units[1:]
    linked = 0
    # Root first: its forward starts the model, its pre-backward hook fires first in backward.
    if blocks:
        root.set_modules_to_forward_prefetch(blocks[:depth])
        root.set_modules_to_backward_prefetch(blocks[::-1][:depth])
        linked += 1
    for index, unit in enumerate(blocks):
        forward = blocks[index + 1 : index + 1 + depth]
        backward = blocks[max(0, index - depth) : index][::-1]
        if forward:
            unit.set_modules_to_forward_prefetch(forward)
        if backward:
            unit.set_modules_to_backward_prefetch(backward)
        linked += bool(forward or backward)
    for unit in units:
        _set_async_unshard(unit, True)
    logger.debug("FSDP prefetch: %d of %d units prefetch their neighbours (depth %d)", linked, len(units), depth)
    return linked


def clear_prefetch(model: nn.Module) -> None:
    """Undo :func:`apply_prefetch`: FSDP2's default (implicit) prefetching and synchronous unshards."""
    for unit in _unit_modules(model):
        torch_internals.clear_prefetch_targets(torch_internals.fsdp_state(unit))
        _set_async_unshard(unit, False)
