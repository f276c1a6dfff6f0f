"""QSDP on FSDP2: quantized weight all-gather and gradient reduce-scatter as FSDP2 custom comms."""

from ._comms import QuantizedAllGather, QuantizedReduceScatter, UnitPlan
from ._install import QSDPHandle, install_qsdp
from ._seeds import SeedSchedule
from ._units import FSDPUnit, find_units
from .config import QSDPConfig

__all__ = [
    "QSDPConfig",
    "QuantizedAllGather",
    "QuantizedReduceScatter",
    "QSDPHandle",
    "install_qsdp",
    "SeedSchedule",
    "UnitPlan",
    "FSDPUnit",
    "find_units",
]
