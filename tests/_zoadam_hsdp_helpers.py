"""Model, data, hand-written byte oracles and a per-group collective counter for tests/dist/test_zoadam_hsdp.py.

Nothing here calls qaccel: the oracles restate docs/zero_one_adam.md ("Bytes") and FSDP2's dim-0 sharding
(``torch.chunk``: every shard holds ceil(d0 / S) rows except the last ones) by hand, and the counter wraps
torch.distributed, so a test comparing qaccel's meter with them compares two independent sources.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import threading
from collections import Counter
from collections.abc import Iterator
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

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


def ring_all_reduce(nbytes: int, ranks: int) -> int:
    """docs/zero_one_adam.md, "Bytes": a ring all-reduce of nbytes sends 2 (N-1) / N x nbytes per rank."""
    return 2 * (ranks - 1) * nbytes // ranks


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


# ------------------------------------------------------------------------------------------ counter
class GroupCollectiveCounter:
    """Wraps torch.distributed's collectives; each call is attributed to the replica group, the shard group or other.

    A call is attributed by the ranks of its ``group`` argument (None: the world), so it does not matter which
    ProcessGroup object the caller holds. Bytes follow the meter's convention: all-reduce 2 (P-1)/P x input,
    all-to-all (P-1)/P x input, all-gather (P-1) x input, reduce-scatter (P-1) x output.
    """

    NAMES = ("all_reduce", "all_to_all_single", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single")

    def __init__(self, replica_ranks: list[int], shard_ranks: list[int]) -> None:
        self.replica_ranks = sorted(replica_ranks)
        self.shard_ranks = sorted(shard_ranks)
        self.calls: dict[str, Counter[str]] = {"replica": Counter(), "shard": Counter(), "other": Counter()}
        self.sent_bytes: Counter[str] = Counter()
        self._inside = threading.local()  # count the outermost call only (one wrapped API may call another)

    def _level(self, group: dist.ProcessGroup | None) -> str:
        ranks = sorted(dist.get_process_group_ranks(group)) if group is not None else list(range(dist.get_world_size()))
        if ranks == self.replica_ranks:
            return "replica"
        return "shard" if ranks == self.shard_ranks else "other"

    @staticmethod
    def _bytes(name: str, arguments: dict, ranks: int) -> int:
        if name == "all_reduce":
            tensor = arguments["tensor"]
            return ring_all_reduce(tensor.numel() * tensor.element_size(), ranks)
        if name == "all_to_all_single":
            tensor = arguments["input"]
            return (ranks - 1) * tensor.numel() * tensor.element_size() // ranks
        if name == "reduce_scatter_single":
            tensor = arguments["output"]
            return (ranks - 1) * tensor.numel() * tensor.element_size()
        tensor = arguments["input_tensor"]
        return (ranks - 1) * tensor.numel() * tensor.element_size()

    @contextlib.contextmanager
    def counting(self) -> Iterator[GroupCollectiveCounter]:
        originals = {name: getattr(dist, name) for name in self.NAMES if hasattr(dist, name)}

        def wrap(name, fn):
            signature = inspect.signature(fn)

            def counted(*args, **kwargs):
                if getattr(self._inside, "active", False):
                    return fn(*args, **kwargs)
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                group = bound.arguments.get("group")
                level = self._level(group)
                self.calls[level]["all_gather" if name.startswith("all_gather") else name] += 1
                self.sent_bytes[level] += self._bytes(name, bound.arguments, dist.get_world_size(group))
                self._inside.active = True
                try:
                    return fn(*args, **kwargs)
                finally:
                    self._inside.active = False

            return counted

        with mock.patch.multiple(dist, **{name: wrap(name, fn) for name, fn in originals.items()}):
            yield self

    def total_calls(self) -> int:
        return sum(sum(c.values()) for c in self.calls.values())
