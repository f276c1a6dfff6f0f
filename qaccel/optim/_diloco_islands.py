"""What an island is for DiLoCo: a DDP rank, or one shard group of an HSDP model; and how islands stop talking.

- DDP (or one process): every rank is an island; the islands are the default group's ranks, and
  DDP's ``no_sync`` keeps each rank's gradient its own (as Accelerate's ``LocalSGD`` does).
- HSDP (FSDP2 units on the intra-node mesh of S ranks, ``replica_group`` joining the R ranks that hold
  the same shard): each shard group is an island. The pseudo-gradient of a shard is averaged over
  the replica group only, so every rank keeps global weights for its own shards, and hierarchical
  QSDP's per-step replica all-reduce is paused (:func:`qaccel.fsdp.replica_sync_paused`).

A model sharded over all ranks with no replica group (a 1-D FSDP mesh) has one island, whose ranks
hold pieces of one model: refused, as is FSDP2's native 2-D HSDP (it cannot leave replicas apart).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ..fsdp import island_units, replica_sync_paused

__all__ = ["Islands", "find_islands"]


@dataclass
class Islands:
    """The islands a DiLoCo run averages over, seen from this rank.

    Attributes:
        group: the ranks holding the same values as this rank's in the other islands (None: one process).
        count: how many islands there are (the group's size).
        params: the trainable parameters (DTensors under HSDP: this rank holds their local shards).
        apart: a context manager factory; while active, islands do not sync gradients.
    """

    group: dist.ProcessGroup | None
    count: int
    params: list[nn.Parameter]
    apart: Callable[[], AbstractContextManager[Any]]

    def local_tensors(self) -> list[torch.Tensor]:
        """The values this rank holds of each trainable parameter (its local shard under HSDP), as views that write through."""
        return [p.to_local() if isinstance(p, DTensor) else p for p in self.params]

    def quantizable(self) -> list[bool]:
        """Per parameter, whether its pseudo-gradient may be quantized: a matrix (by its full shape) of >= 1024 values."""
        return [p.dim() >= 2 and p.numel() >= 1024 for p in self.params]


def find_islands(model: nn.Module, replica_group: dist.ProcessGroup | None) -> Islands:
    """The islands of ``model``; raise ValueError (naming the fix) when its ranks cannot be islands."""
    params = [p for p in model.parameters() if p.requires_grad]
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return _hsdp_islands(model, replica_group, params)
    if replica_group is not None:
        raise ValueError(
            "DiLoCo(replica_group=...): the model is not sharded with FSDP2; replica_group names the islands of an HSDP "
            "model only (under DDP every rank is an island)"
        )
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return Islands(None, 1, params, contextlib.nullcontext)
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError(
            f"DiLoCo: the model is a {type(model).__name__}, not DistributedDataParallel, on {dist.get_world_size()} ranks: "
            "pass the model accelerator.prepare returned (DDP), whose per-step gradient sync DiLoCo turns off"
        )
    return Islands(dist.group.WORLD, dist.get_world_size(), params, model.no_sync)


def _hsdp_islands(model: nn.Module, replica_group: dist.ProcessGroup | None, params: list[nn.Parameter]) -> Islands:
    units, group = island_units(model, replica_group, "DiLoCo")
    replicas = dist.get_world_size(group)
    return Islands(group, replicas, params, lambda: replica_sync_paused(units, replicas))
