"""Hierarchical QSDP names every rank's seeds by its own rank, also when the root unit holds no parameter.

The seed owner of a rank is its index among all ranks of the model, ``replica * S + shard rank``
(``docs/qsdp.md``, "Seeds"). The shard rank must come from the shard group itself: a root unit
over the blocks that holds no parameter of its own has no mesh to read it from, and reading it
there would give every shard rank of a node the same owner, so they would round with the same
noise. Oracle: the ranks torch.distributed itself reports in the shard and replica groups.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tests._dist import run_ranks

SHARDS = 2


def _parameter_free_root() -> nn.Module:
    torch.manual_seed(0)
    # The root Sequential has no parameter of its own: every one lives in a block.
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))


def _owners(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from qaccel.comm import WireMeter
    from qaccel.fsdp import QSDPConfig, QuantizedReduceScatter, QuantizedReplicaAllReduce, install_qsdp

    mesh = init_device_mesh("cpu", (world_size // SHARDS, SHARDS), mesh_dim_names=("replicate", "shard"))
    shard_group, replica_group = mesh["shard"].get_group(), mesh["replicate"].get_group()
    model = _parameter_free_root()
    fully_shard(model[0], mesh=mesh["shard"])
    fully_shard(model[2], mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    config = QSDPConfig(weight_bits=8, grad_bits=8, replica_grad_bits=8, unit_min_numel=0, prefetch=False, overlap_reduce_scatter=False)
    handle = install_qsdp(model, config, meter=WireMeter(), replica_group=replica_group)
    # The owners the seeds are drawn with during a real backward, not only the stored attribute.
    used = set()
    replica_seed = handle.seeds.replica_seed

    def spy(unit, owner, direction, dest, call):
        used.add(owner)
        return replica_seed(unit, owner, direction, dest, call)

    handle.seeds.replica_seed = spy
    torch.manual_seed(100 + rank)
    model(torch.randn(4, 64)).sum().backward()
    expected = dist.get_rank(replica_group) * SHARDS + dist.get_rank(shard_group)
    return {
        "root_params": len(handle.units[0].params),
        "expected": expected,
        "hook_owners": sorted({ar.owner for ar in handle.replica_all_reduces if isinstance(ar, QuantizedReplicaAllReduce)}),
        "used_owners": sorted(used),
        "rs_offsets": sorted({rs.owner_offset for rs in handle.reduce_scatters if isinstance(rs, QuantizedReduceScatter)}),
        "expected_offset": dist.get_rank(replica_group) * SHARDS,
    }


def test_shard_ranks_of_a_node_get_distinct_seed_owners_with_a_parameter_free_root(tmp_path):
    results = run_ranks(_owners, 4, tmp_path)
    for out in results:
        assert out["root_params"] == 0  # the case under test: the first unit holds no parameter
        assert out["hook_owners"] == [out["expected"]]
        assert out["used_owners"] == [out["expected"]]
        assert out["rs_offsets"] == [out["expected_offset"]]
    assert sorted(out["expected"] for out in results) == [0, 1, 2, 3]  # one owner per rank, none shared
