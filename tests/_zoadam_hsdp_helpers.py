"""Model, data and hand-written byte oracles for tests/dist/test_zoadam_hsdp.py.

Nothing here calls qaccel: the oracles restate docs/zero_one_adam.md ("Bytes") and FSDP2's dim-0 sharding
(``torch.chunk``: every shard holds ceil(d0 / S) rows except the last ones) by hand; the collectives are counted by
the harness's ``CollectiveRecorder`` (``tests._collectives``), so a test comparing qaccel's meter with them compares
two independent sources.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from tests._collectives import ring_all_reduce

TABLE_ROWS = 10
WIDTH = 8
HIDDEN = 33  # odd: with S = 2, FSDP2 pads fc1's dim 0 to 34 and the two shards differ in size (17 vs 16 rows)
OUT = 5
# Rows the data ever indexes; the others never get a gradient and are masked. Not periodic in the shard length
# (5 rows for S = 2), so a mask sliced for the wrong shard unmasks or masks a different set of rows.
USED_ROWS = (0, 2, 3, 7)
# The shapes of each FSDP2 unit's parameters, in the order fully_shard registers them (see shard_model).
UNIT_SHAPES = (((HIDDEN, WIDTH), (HIDDEN,)), ((OUT, HIDDEN), (OUT,)), ((TABLE_ROWS, WIDTH),))
# The optimizer's parameters in model.parameters() order: table, fc1.weight, fc1.bias, fc2.weight, fc2.bias.
PARAM_SHAPES = ((TABLE_ROWS, WIDTH), (HIDDEN, WIDTH), (HIDDEN,), (OUT, HIDDEN), (OUT,))


class TinyRegressor(nn.Module):
    """An embedding-like table (rows outside USED_ROWS never get a gradient) under a two-layer MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(0.5 * torch.randn(TABLE_ROWS, WIDTH))
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, OUT)

    def forward(self, rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(self.table[rows] + x)))


def make_model(seed: int) -> TinyRegressor:
    torch.manual_seed(seed)
    return TinyRegressor()


def shard_model(model: TinyRegressor, shard_mesh) -> TinyRegressor:
    """Three FSDP2 units on the 1-D intra-node mesh: fc1, fc2 and the root (which holds the table)."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.fc1, mesh=shard_mesh)
    fully_shard(model.fc2, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    return model


@functools.cache
def _teacher() -> TinyRegressor:
    return make_model(10_000)


def batch(seed: int, step: int, rank: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, x, target) of one rank's micro-batch; targets come from a fixed random teacher network."""
    generator = torch.Generator().manual_seed(1_000_003 * seed + 1000 * step + rank)
    used = torch.tensor(USED_ROWS)
    rows = used[torch.randint(0, len(USED_ROWS), (size,), generator=generator)]
    x = torch.randn(size, WIDTH, generator=generator)
    with torch.no_grad():
        target = _teacher()(rows, x)
    return rows, x, target


def table_mask() -> torch.Tensor:
    mask = torch.zeros(TABLE_ROWS, WIDTH)
    mask[list(USED_ROWS)] = 1.0
    return mask


def param_groups(model: TinyRegressor, mask: bool) -> list[dict]:
    """The table alone in a group (DeepSpeed's exp_avg_mask needs one parameter per group), the MLP in another."""
    table_group = {"params": [model.table]}
    if mask:
        table_group["exp_avg_mask"] = table_mask()
    return [table_group, {"params": [model.fc1.weight, model.fc1.bias, model.fc2.weight, model.fc2.bias]}]


# ------------------------------------------------------------------------------------------ oracles
def shard_rows(dim0: int, shards: int, index: int) -> int:
    """Rows of shard ``index`` under FSDP2's dim-0 sharding (torch.chunk: ceil(d0 / S) rows each, the tail short)."""
    per_shard = math.ceil(dim0 / shards)
    return max(0, min(per_shard, dim0 - index * per_shard))


def local_numel(shape: tuple[int, ...], shards: int, index: int) -> int:
    return shard_rows(shape[0], shards, index) * math.prod(shape[1:])


def padded_shard_numel(shape: tuple[int, ...], shards: int) -> int:
    """Elements of the parameter in FSDP2's reduce-scatter output (dim 0 padded to a multiple of S)."""
    return math.ceil(shape[0] / shards) * math.prod(shape[1:])


def full_step_inter_node_bytes(replicas: int, shards: int) -> int:
    """A FULL step: one fp32 ring all-reduce over the replicas per FSDP2 unit, of the unit's padded gradient shard."""
    return sum(ring_all_reduce(4 * sum(padded_shard_numel(s, shards) for s in unit), replicas) for unit in UNIT_SHAPES)


def onebit_step_inter_node_bytes(replicas: int, numels: list[int]) -> int:
    """One 1-bit all-reduce of tensors of ``numels`` elements: 2 (N-1) (M'/(8N) + 4) bytes each (docs, "Bytes").

    M' is M padded to a multiple of N lcm(N, 8) (``padding="deepspeed"``, the default); empty tensors send nothing.
    """
    multiple = replicas * math.lcm(replicas, 8)
    total = 0
    for numel in numels:
        if numel == 0:
            continue
        padded = math.ceil(numel / multiple) * multiple
        total += 2 * (replicas - 1) * (padded // (8 * replicas) + 4)
    return total
