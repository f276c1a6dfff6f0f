"""What ``scripts/train.py`` is built from: method set-up, checkpoints, evaluation, the metrics log, guards.

Above ``qaccel.integration`` and ``qaccel.zoo``: it turns a recipe and flags into a run.
"""

from .checkpoints import (
    CheckpointError,
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    resolve_resume,
    save_checkpoint,
    verify_checkpoint,
)
from .collate import BatchSeededCollator
from .evaluation import evaluate_model
from .faults import DEFAULT_COLLECTIVE_TIMEOUT_S, FaultReporter, is_collective_failure
from .guards import (
    ENV_CHECK_REPLICAS,
    NonFiniteError,
    NonFiniteGuard,
    ReplicaGuard,
    ReplicaMismatchError,
    TrainingGuards,
    replica_check_interval,
)
from .methods import METHODS, MethodPlan, build_accelerator, build_optimizer, meter_stock_ddp, plan_method
from .metrics_log import MetricsLog, read_metrics

__all__ = [
    "BatchSeededCollator",
    "METHODS",
    "MethodPlan",
    "plan_method",
    "build_accelerator",
    "build_optimizer",
    "meter_stock_ddp",
    "CheckpointError",
    "checkpoint_path",
    "latest_checkpoint",
    "list_checkpoints",
    "resolve_resume",
    "save_checkpoint",
    "verify_checkpoint",
    "evaluate_model",
    "MetricsLog",
    "read_metrics",
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "FaultReporter",
    "is_collective_failure",
    "ENV_CHECK_REPLICAS",
    "NonFiniteError",
    "NonFiniteGuard",
    "ReplicaGuard",
    "ReplicaMismatchError",
    "TrainingGuards",
    "replica_check_interval",
]
