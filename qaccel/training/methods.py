"""From a method name to the Accelerator, plugin and optimizer that run it.

``scripts/train.py`` picks its distributed set-up from the method alone, so plain ``torchrun``
works without a launch file: QSDP needs FSDP2, the 1-bit optimizers run on DDP (their comm hook
replaces DDP's all-reduce), and ``none`` runs the same sharding as the recipe's own method, so a
stock run is the like-for-like baseline of the compressed one. A launch file that asks for
DeepSpeed is refused before any process group work starts. A 1-bit optimizer launched with an FSDP
config runs on HSDP shards (``dp_replicate_size`` >= 2 replicas of ``dp_shard_size`` shards, the
optimizer compressing across replicas); its intra-node QSDP codecs are off unless ``--qsdp_*`` flags
or ``QACCEL_QSDP_*`` variables turn them on. DiLoCo runs on DDP (every rank an island) or, with an
HSDP launch config, on HSDP shards (every node's shard group an island, QSDP's codecs inside it as
for the 1-bit optimizers).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from .._settings import env_flag
from ..fsdp import QSDPConfig
from ..optim import OneBitAdam, ZeroOneAdam
from ..optim.config import OneBitAdamConfig, ZeroOneAdamConfig
from ..optim.diloco_config import DiLoCoConfig
from .comm_options import CommOptions, install_comm_options
from .faults import DEFAULT_COLLECTIVE_TIMEOUT_S, process_group_timeout

__all__ = [
    "METHODS",
    "LAUNCH_FROM_ENV",
    "MethodPlan",
    "launch_config_parallelism",
    "launch_config_for_method",
    "plan_method",
    "build_accelerator",
    "build_optimizer",
    "decay_param_groups",
    "meter_stock_ddp",
]

METHODS = ("qsdp", "zero_one_adam", "onebit_adam", "diloco", "none")
LAUNCH_FROM_ENV = "env"  # plan_method's default: read the launch's parallelism from Accelerate's variables
_ONEBIT_CONFIGS = {"zero_one_adam": ZeroOneAdamConfig, "onebit_adam": OneBitAdamConfig}
# The methods that own the traffic across HSDP replicas: QSDP's codecs inside a node only.
_REPLICA_OWNERS = (*_ONEBIT_CONFIGS, "diloco")


@dataclass(frozen=True)
class MethodPlan:
    """What one run does: the method, its parallelism and its fully resolved settings."""

    method: str  # one of METHODS
    parallelism: str  # "fsdp2" or "ddp"
    qsdp: QSDPConfig | None  # the QSDP settings (both paths off for a stock FSDP2 run)
    onebit: ZeroOneAdamConfig | OneBitAdamConfig | None  # the 1-bit optimizer's settings
    comm: CommOptions = CommOptions()
    diloco: DiLoCoConfig | None = None  # DiLoCo's outer loop (--method diloco)  # the baseline options (DDP hook and buckets, FSDP2's reduce-scatter)

    def __post_init__(self) -> None:
        self.comm.check_plan(self.method, self.parallelism, self.qsdp)  # an option the run cannot honour is refused

    @property
    def is_stock_ddp(self) -> bool:
        """Plain DDP with AdamW (``none`` on DDP): its all-reduce is metered where no hook compresses it."""
        return self.method == "none" and self.parallelism == "ddp"

    def config_dict(self) -> dict[str, Any]:
        """The method's full config as JSON-able values (recorded in checkpoints and metrics)."""
        if self.method == "qsdp":
            return self.qsdp.to_dict()
        if self.onebit is not None:
            return self.onebit.to_dict()
        if self.diloco is not None:
            return {**self.diloco.to_dict(), "parallelism": self.parallelism, "qsdp": None if self.qsdp is None else self.qsdp.to_dict()}
        return {"parallelism": self.parallelism}


def _launch_parallelism() -> str | None:
    """The parallelism an ``accelerate launch`` config asked for, if any (FSDP and its mesh are exported as env)."""
    if env_flag("ACCELERATE_USE_FSDP"):
        replicas = int(os.environ.get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "1") or 1)
        return "hsdp" if replicas > 1 else "fsdp2"
    if env_flag("ACCELERATE_USE_DEEPSPEED"):
        return "deepspeed"
    return None


def launch_config_parallelism(config_file: str | os.PathLike) -> str | None:
    """The parallelism an Accelerate config file asks for (``fsdp2``, ``hsdp``: FSDP with
    ``parallelism_config_dp_replicate_size`` >= 2, ``deepspeed`` or None), read with Accelerate's own
    loader, as ``accelerate launch`` will read it.

    Raises:
        ValueError: the file does not exist or Accelerate cannot read it.
    """
    from accelerate.commands.config.config_args import load_config_from_file

    if not os.path.isfile(config_file):
        raise ValueError(f"launch config {str(config_file)!r}: no such file")
    try:
        config = load_config_from_file(str(config_file))
    except Exception as err:  # noqa: BLE001 - yaml, key and value errors of Accelerate's loader alike
        raise ValueError(f"launch config {str(config_file)!r}: Accelerate cannot read it: {err}") from None
    kind = str(config.distributed_type).rsplit(".", 1)[-1]  # DistributedType.FSDP -> FSDP
    replicas = int((config.parallelism_config or {}).get("parallelism_config_dp_replicate_size", 1) or 1)
    if kind == "FSDP" and replicas > 1:
        return "hsdp"
    return {"FSDP": "fsdp2", "DEEPSPEED": "deepspeed"}.get(kind)


# The parallelisms each method runs on (launch_config_parallelism's values; None: DDP or one process).
_RUNS_ON: dict[str, tuple[str | None, ...]] = {
    "qsdp": ("fsdp2", "hsdp"),
    "zero_one_adam": (None, "hsdp"),
    "onebit_adam": (None, "hsdp"),
    "diloco": (None, "hsdp"),
    "none": (None, "fsdp2", "hsdp"),
}
# A shipped config's twin on the same hardware and process count, for the other parallelism.
_TWIN_SUFFIXES = {"_qsdp": "_ddp", "_ddp": "_qsdp"}


def launch_config_for_method(method: str, recipe_config: str | os.PathLike) -> Path:
    """The launch config of a recipe's run under another ``--method``, when none is given.

    The recipe's own config when it can run ``method`` (QSDP needs FSDP2, the 1-bit optimizers
    DDP or HSDP); otherwise its shipped twin for the other parallelism on the same hardware and
    process count (``cpu_2proc_qsdp`` <-> ``cpu_2proc_ddp``, ``gpu_1node_8_qsdp`` <->
    ``gpu_1node_8_ddp``), as a run without a recipe picks ``DEFAULT_LAUNCH_CONFIGS[method]``.
    Without a twin the recipe's config is returned, and the input check names the configs that work.

    Raises:
        ValueError: an unknown method, or a config Accelerate cannot read.
    """
    from .._resources import launch_config_path

    if method not in _RUNS_ON:
        raise ValueError(f"--method {method!r}: unknown; choose one of {', '.join(METHODS)}")
    config = Path(recipe_config)
    if launch_config_parallelism(config) in _RUNS_ON[method]:
        return config
    stem = config.stem
    for suffix, twin in _TWIN_SUFFIXES.items():
        if stem.endswith(suffix):
            try:
                candidate = launch_config_path(stem[: -len(suffix)] + twin)
            except ValueError:  # no shipped twin
                return config
            return candidate if launch_config_parallelism(candidate) in _RUNS_ON[method] else config
    return config


def plan_method(
    method: str,
    *,
    recipe_method: str,
    recipe_qsdp: dict[str, Any],
    flag_qsdp: dict[str, Any],
    recipe_onebit: dict[str, Any],
    flag_onebit: dict[str, Any],
    learning_rate: float,
    weight_decay: float,
    launch_parallelism: str | None = LAUNCH_FROM_ENV,
    comm: CommOptions | None = None,
    recipe_diloco: dict[str, Any] | None = None,
    flag_diloco: dict[str, Any] | None = None,
) -> MethodPlan:
    """Resolve and validate the method's settings; refuse launches that contradict it.

    Args:
        method: the run's method (flag or recipe).
        recipe_method: the recipe's own method; decides the parallelism of ``none``.
        recipe_qsdp, flag_qsdp: ``QSDPConfig`` fields from the recipe and from ``--qsdp_*`` flags.
        recipe_onebit, flag_onebit: ``ZeroOneAdamConfig`` / ``OneBitAdamConfig`` fields from the
            recipe and from ``--zoadam_*`` flags; ``lr`` and ``weight_decay`` default to the training settings.
        launch_parallelism: what the launch asks for (``fsdp2``, ``hsdp``, ``deepspeed`` or None); default:
            read from the variables ``accelerate launch`` exports (a check before launching passes
            :func:`launch_config_parallelism` of the config file instead).
        comm: the baseline options (``--ddp_comm_hook``, ...; None: none), checked by ``CommOptions.check_plan``.
        recipe_diloco, flag_diloco: ``DiLoCoConfig`` fields from the recipe and from ``--diloco_*`` flags.

    Precedence, as everywhere in qaccel: flag (argument), then ``QACCEL_*`` environment, then
    the recipe, then the default.

    Raises:
        ValueError: an unknown method, a bad setting (naming it), a launch that asks for DeepSpeed,
            an FSDP launch of a 1-bit optimizer or DiLoCo without replicas (``dp_replicate_size`` < 2), a comm option it
            cannot honour.
    """
    if method not in METHODS:
        raise ValueError(f"--method {method!r}: unknown; choose one of {', '.join(METHODS)}")
    if recipe_method not in METHODS:
        raise ValueError(f"recipe method {recipe_method!r}: unknown; choose one of {', '.join(METHODS)}")
    launch = _launch_parallelism() if launch_parallelism == LAUNCH_FROM_ENV else launch_parallelism
    if launch == "deepspeed":
        raise ValueError(
            "the launch config asks for DeepSpeed (ACCELERATE_USE_DEEPSPEED=true); qaccel methods run on "
            "FSDP2 (qsdp) or DDP (zero_one_adam, onebit_adam): use launch_configs/cpu_2proc_qsdp.yaml or cpu_2proc_ddp.yaml"
        )
    fsdp_launch = launch in ("fsdp2", "hsdp")
    if method == "qsdp" or (method == "none" and (recipe_method == "qsdp" or fsdp_launch)):
        parallelism = "fsdp2"
    elif method in _REPLICA_OWNERS and fsdp_launch:
        if launch != "hsdp":
            raise ValueError(
                f"--method {method} with an FSDP launch config: runs on HSDP shards and needs parallelism_config "
                "parallelism_config_dp_replicate_size >= 2 (got 1); use the shipped launch config cpu_2x2_hqsdp "
                "(qaccel train --launch_config cpu_2x2_hqsdp), or a DDP launch (cpu_2proc_ddp, plain torchrun)"
            )
        parallelism = "fsdp2"  # on HSDP shards: sharded within a node, the method's own traffic across replicas
    else:
        parallelism = "ddp"
    qsdp = _qsdp_settings(method, recipe_qsdp, flag_qsdp) if parallelism == "fsdp2" else None
    onebit = None
    if method in _ONEBIT_CONFIGS:
        cls = _ONEBIT_CONFIGS[method]
        _refuse_unknown(method, {**recipe_onebit, **flag_onebit}, set(cls.field_names()))
        base = {"lr": learning_rate, "weight_decay": weight_decay, **recipe_onebit}
        onebit = cls.from_env(recipe=base, **flag_onebit)
    diloco = None
    if method == "diloco":
        _refuse_unknown(method, {**(recipe_diloco or {}), **(flag_diloco or {})}, set(DiLoCoConfig.field_names()))
        diloco = DiLoCoConfig.from_env(recipe=recipe_diloco or {}, **(flag_diloco or {}))
    return MethodPlan(method=method, parallelism=parallelism, qsdp=qsdp, onebit=onebit, comm=comm or CommOptions(), diloco=diloco)


def _qsdp_settings(method: str, recipe_qsdp: dict[str, Any], flag_qsdp: dict[str, Any]) -> QSDPConfig:
    """The QSDP config of an FSDP2 run of ``method``: the qsdp method's own, stock FSDP2's, or codecs inside a node only."""
    _refuse_unknown("qsdp", {**recipe_qsdp, **flag_qsdp}, {f.name for f in fields(QSDPConfig)})
    settings, recipe_section = dict(flag_qsdp), recipe_qsdp
    if method == "none":  # stock FSDP2 (or HSDP), its traffic still counted by pass-through comms
        settings.update(weight_bits=None, grad_bits=None, replica_grad_bits=None)
    elif method in _REPLICA_OWNERS:
        if flag_qsdp.get("replica_grad_bits") is not None:
            owner = "DiLoCo sends only the outer pseudo-gradients (--diloco_outer_bits)" if method == "diloco" else (
                "the optimizer compresses the traffic across replicas itself (1 bit, or nothing on local steps)"
            )
            raise ValueError(f"--qsdp_replica_grad_bits={flag_qsdp['replica_grad_bits']}: with --method {method} {owner}; drop the flag")
        settings["replica_grad_bits"] = None
        # The recipe's qsdp section configures the qsdp method; exact inside a node unless asked.
        recipe_section = {"weight_bits": None, "grad_bits": None}
    # the recipe's section sits where a config file would: below the QACCEL_QSDP_* variables
    return QSDPConfig.from_env(recipe=recipe_section, **settings)


def _refuse_unknown(section: str, settings: dict[str, Any], known: set[str]) -> None:
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(f"{section} settings: unknown keys {unknown}; known: {', '.join(sorted(known))}")


def build_accelerator(
    plan: MethodPlan,
    *,
    layer_cls: str | None,
    mixed_precision: str,
    gradient_accumulation_steps: int,
    report_to: str | None,
    project_dir: str,
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
) -> Any:
    """A ``qaccel.Accelerator`` for ``plan``: FSDP2 with a ``QSDPPlugin``, or DDP.

    ``collective_timeout_s`` bounds every collective of the process group, so a hung peer turns into
    an error on the others instead of a silent wait (see :mod:`qaccel.training.faults`).
    """
    from accelerate.utils import (
        DataLoaderConfiguration,
        DistributedDataParallelKwargs,
        InitProcessGroupKwargs,
        ProjectConfiguration,
    )

    from ..integration import Accelerator, QSDPPlugin

    timeout = process_group_timeout(collective_timeout_s)  # checked before any process group exists

    kwargs: dict[str, Any] = dict(
        mixed_precision=mixed_precision,
        gradient_accumulation_steps=gradient_accumulation_steps,
        log_with=report_to,
        project_config=ProjectConfiguration(project_dir=project_dir, logging_dir=os.path.join(project_dir, "logs")),
        # A sampler seeded per epoch: the data order is a function of (seed, epoch), so a resumed
        # run can find its place by skipping batches.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)],
    )
    if plan.parallelism == "fsdp2":
        fsdp: dict[str, Any] = {"state_dict_type": "SHARDED_STATE_DICT"}
        if "FSDP_AUTO_WRAP_POLICY" not in os.environ:
            fsdp["auto_wrap_policy"] = "transformer_based_wrap"
        if layer_cls and "FSDP_TRANSFORMER_CLS_TO_WRAP" not in os.environ:
            fsdp["auto_wrap_policy"] = "transformer_based_wrap"
            fsdp["transformer_cls_names_to_wrap"] = [layer_cls]
        kwargs["fsdp_plugin"] = QSDPPlugin(qsdp_config=plan.qsdp, **fsdp)
    elif plan.comm.ddp_bucket_cap_mb is not None:  # Accelerate hands it to DistributedDataParallel at prepare
        kwargs["kwargs_handlers"].append(DistributedDataParallelKwargs(bucket_cap_mb=plan.comm.ddp_bucket_cap_mb))
    return Accelerator(**kwargs)


def decay_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Matrices decay; biases and norm weights do not (the usual transformer rule)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def build_optimizer(plan: MethodPlan, model: torch.nn.Module, *, learning_rate: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW for ``qsdp`` and ``none``; ``ZeroOneAdam`` / ``OneBitAdam`` with the plan's settings."""
    groups = decay_param_groups(model, weight_decay)
    if plan.method == "zero_one_adam":
        return ZeroOneAdam(groups, config=plan.onebit)
    if plan.method == "onebit_adam":
        return OneBitAdam(groups, config=plan.onebit)
    return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95), eps=1e-8)


def meter_stock_ddp(accelerator: Any, model: torch.nn.Module, plan: MethodPlan) -> bool:
    """Count a stock DDP run's all-reduce bytes in the wire meter (numerics unchanged).

    Only for ``none`` on DDP without ``--ddp_comm_hook`` (those hooks meter themselves): the 1-bit
    optimizers install their own hook, and FSDP2 runs count through QSDP's pass-through comms. Returns
    whether a hook was installed (not with one process, where Accelerate does not wrap the model in DDP).
    The training entry installs it with its other options, through :func:`install_comm_options`.
    """
    if plan.comm.ddp_comm_hook != "none":
        return False
    return install_comm_options(accelerator, model, CommOptions(), stock_ddp=plan.is_stock_ddp) is not None
