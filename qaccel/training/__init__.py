"""What ``scripts/train.py`` is built from: method set-up, the resume rules, evaluation, the metrics log, guards.

Above ``qaccel.integration`` and ``qaccel.zoo``: it turns a recipe and flags into a run. The checkpoint
format itself (saving, verifying, rotating) is ``qaccel.checkpoint``.
"""

from .collate import BatchSeededCollator
from .evaluation import evaluate_model
from .faults import DEFAULT_COLLECTIVE_TIMEOUT_S, FaultReporter, is_collective_failure, process_group_timeout
from .guards import (
    ENV_CHECK_REPLICAS,
    NonFiniteError,
    NonFiniteGuard,
    ReplicaGuard,
    ReplicaMismatchError,
    TrainingGuards,
    replica_check_interval,
)
from .loaders import MapStyleTrainLoader, StreamingTrainLoader, TrainLoader, build_train_loader
from .methods import METHODS, MethodPlan, build_accelerator, build_optimizer, meter_stock_ddp, plan_method
from .metrics_log import MetricsLog, read_metrics
from .resume import check_resume
from .run_settings import TrainingSettings

__all__ = [
    "BatchSeededCollator",
    "METHODS",
    "MethodPlan",
    "plan_method",
    "build_accelerator",
    "build_optimizer",
    "meter_stock_ddp",
    "check_resume",
    "evaluate_model",
    "MetricsLog",
    "read_metrics",
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "FaultReporter",
    "is_collective_failure",
    "process_group_timeout",
    "ENV_CHECK_REPLICAS",
    "NonFiniteError",
    "NonFiniteGuard",
    "ReplicaGuard",
    "ReplicaMismatchError",
    "TrainingGuards",
    "replica_check_interval",
    "TrainingSettings",
    "TrainLoader",
    "MapStyleTrainLoader",
    "StreamingTrainLoader",
    "build_train_loader",
]
