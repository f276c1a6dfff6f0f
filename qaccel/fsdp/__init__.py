"""QSDP on FSDP2: quantized weight all-gather and gradient reduce-scatter as FSDP2 custom comms."""

from ._comms import QuantizedAllGather, QuantizedReduceScatter, UnitPlan
from ._install import QSDPHandle, install_qsdp
from ._prefetch import apply_prefetch, clear_prefetch
from ._replica import (
    INTER_NODE_KINDS,
    KIND_REPLICA_AR,
    ReplicaAllReduce,
    ReplicaChunking,
    bytes_by_level,
    is_inter_node,
)
from ._seeds import SeedSchedule
from ._units import AllReduceHook, FSDPUnit, HookOwner, check_replica_group, find_units, padded_shard_numel
from .config import QSDPConfig

__all__ = [
    "QSDPConfig",
    "QuantizedAllGather",
    "QuantizedReduceScatter",
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
    "ReplicaAllReduce",
    "ReplicaChunking",
    "bytes_by_level",
    "INTER_NODE_KINDS",
    "KIND_REPLICA_AR",
    "is_inter_node",
]
