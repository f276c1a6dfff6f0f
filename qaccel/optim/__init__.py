"""0/1 Adam and 1-bit Adam for data-parallel training (DDP, or HSDP shards), with DeepSpeed's key names and semantics.

``ZeroOneAdam`` / ``OneBitAdam`` are torch optimizers; their 1-bit error-feedback all-reduce is
:func:`qaccel.comm.compressed_allreduce`. Whether a step's gradients are all-reduced in full precision is
decided by the optimizer's :class:`CommPlan`, which the DDP hook installed by
:func:`register_ddp_comm_hook`, or the FSDP2 all-reduce hook installed by :func:`register_hsdp_comm_hook`
on a model sharded within nodes and replicated across them, reads (``qaccel.Accelerator.prepare``
installs the right one). The hook attaches the optimizer to one :class:`OneBitPlacement` (its groups,
meter and overlap), and every transport uses only the optimizer's :class:`OneBitPort`.
"""

from ._base import OneBitOptimizerBase
from ._ddp_hook import OneBitCommHookState, onebit_comm_hook, register_ddp_comm_hook
from ._hsdp_hook import OneBitReplicaHook, register_hsdp_comm_hook
from ._port import OneBitPlacement, OneBitPort
from ._schedule import CommPlan, OneBitAdamSchedule, Phase, StepKind, ZeroOneAdamSchedule, count_step_kinds
from ._variance_bias import (
    MAX_FROZEN_STEP_FACTOR,
    frozen_step_factor,
    frozen_variance_factor,
    frozen_variance_problem,
    smallest_safe_freeze_step,
    variance_updates_at_freeze,
)
from .config import GRANULARITIES, OneBitAdamConfig, ZeroOneAdamConfig
from .diloco import DiLoCo
from .diloco_config import DiLoCoConfig
from .onebit_adam import OneBitAdam
from .zero_one_adam import ZeroOneAdam

__all__ = [
    "DiLoCo",
    "DiLoCoConfig",
    "ZeroOneAdam",
    "OneBitAdam",
    "ZeroOneAdamConfig",
    "OneBitAdamConfig",
    "GRANULARITIES",
    "OneBitOptimizerBase",
    "OneBitPlacement",
    "OneBitPort",
    "StepKind",
    "Phase",
    "ZeroOneAdamSchedule",
    "OneBitAdamSchedule",
    "CommPlan",
    "count_step_kinds",
    "OneBitCommHookState",
    "onebit_comm_hook",
    "register_ddp_comm_hook",
    "OneBitReplicaHook",
    "register_hsdp_comm_hook",
    "MAX_FROZEN_STEP_FACTOR",
    "frozen_step_factor",
    "frozen_variance_factor",
    "frozen_variance_problem",
    "smallest_safe_freeze_step",
    "variance_updates_at_freeze",
]
