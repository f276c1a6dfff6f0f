"""Gradient clipping of the 1-bit optimizers with a norm that is the same on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._torch_internals import foreach_mul_, foreach_norm
from ..comm import ring_all_reduce_bytes
from ._port import OneBitPlacement
from ._schedule import StepKind

__all__ = ["clip_to_consistent_norm"]


def clip_to_consistent_norm(
    grads: list[torch.Tensor], max_norm: float, kind: StepKind, world_size: int, placement: OneBitPlacement
) -> torch.Tensor:
    """Scale ``grads``, in place, to ``max_norm`` with a norm that is the same on every rank; returns the norm.

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

    Args:
        grads: the gradients present (at least one).
        max_norm: the optimizer's ``gradient_clipping`` (> 0).
        kind: the step's kind.
        world_size: ranks of ``placement.process_group``.
        placement: where the norm's all-reduces run and are metered.
    """
    norm = torch.linalg.vector_norm(torch.stack(foreach_norm(grads)))
    if placement.shard_group is not None and dist.get_world_size(placement.shard_group) > 1:
        squared = (norm * norm).reshape(1)
        dist.all_reduce(squared, group=placement.shard_group)
        nbytes = ring_all_reduce_bytes(4, dist.get_world_size(placement.shard_group))
        placement.wire_meter.record("onebit.clip_norm_shard_all_reduce", sent_bytes=nbytes, recv_bytes=nbytes)
        norm = torch.sqrt(squared[0])
    if kind in (StepKind.ONEBIT_GRADIENT, StepKind.ONEBIT_MOMENTUM) and world_size > 1:
        squared = (norm * norm).reshape(1)
        dist.all_reduce(squared, group=placement.process_group)
        placement.wire_meter.record(
            f"{placement.kind_prefix}.clip_norm_all_reduce",
            sent_bytes=ring_all_reduce_bytes(4, world_size),
            recv_bytes=ring_all_reduce_bytes(4, world_size),
        )
        norm = torch.sqrt(squared[0] / world_size)
    foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm
