"""QSDP on FSDP2: quantized weight all-gather and gradient reduce-scatter as FSDP2 custom comms."""

from ._comms import CountedAllGather, CountedReduceScatter, QSDPComm, QuantizedAllGather, QuantizedReduceScatter
from ._install import QSDPHandle, install_qsdp
from ._islands import island_units, replica_sync_paused
from ._plan import UnitPlan, merge_segments, padded_shard_numel
from ._prefetch import apply_prefetch, clear_prefetch
from ._replica import (
    INTER_ISLAND_PREFIX,
    INTER_NODE_KINDS,
    KIND_REPLICA_AR,
    QuantizedReplicaAllReduce,
    ReplicaAllReduce,
    ReplicaChunking,
    bytes_by_level,
    is_inter_node,
)
from ._rs_overlap import OverlappedReduceScatter, SettlingAllGather
from ._seeds import SeedSchedule
from ._units import AllReduceHook, FSDPUnit, HookOwner, check_replica_group, find_units, shard_group
from .config import QSDPConfig

__all__ = [
    "QSDPConfig",
    "QuantizedAllGather",
    "QuantizedReduceScatter",
    "CountedAllGather",
    "CountedReduceScatter",
    "OverlappedReduceScatter",
    "SettlingAllGather",
    "QSDPComm",
    "QSDPHandle",
    "install_qsdp",
    "apply_prefetch",
    "clear_prefetch",
    "SeedSchedule",
    "UnitPlan",
    "FSDPUnit",
    "AllReduceHook",
    "HookOwner",
    "find_units",
    "check_replica_group",
    "padded_shard_numel",
    "merge_segments",
    "shard_group",
    "ReplicaAllReduce",
    "QuantizedReplicaAllReduce",
    "ReplicaChunking",
    "bytes_by_level",
    "INTER_NODE_KINDS",
    "INTER_ISLAND_PREFIX",
    "KIND_REPLICA_AR",
    "is_inter_node",
    "island_units",
    "replica_sync_paused",
]
