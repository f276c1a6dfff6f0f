"""What ``qaccel.Trainer`` settles before transformers builds its Accelerator.

Upstream behaviour this relies on (transformers 5.24, ``trainer.py`` / ``training_args.py``; the
private names are reached through :mod:`qaccel.integration._transformers_internals`):

1. ``TrainingArguments.__post_init__`` already sets up the process group and Accelerate's
   ``PartialState``. Under ``torchrun`` on a machine without a GPU and without ``use_cpu=True`` it
   gets ``DistributedType.NO``: every process then trains alone on all the data and each believes
   it is the main process. :func:`ensure_cpu_distributed` redoes that set-up with ``use_cpu=True``
   (what the user would have had to pass), which gives ``MULTI_CPU`` over gloo.
2. ``Trainer.create_accelerator_and_postprocess`` builds ``accelerate.Accelerator(**args)`` through
   the name ``Accelerator`` imported at the top of ``transformers.trainer``; no argument or method
   chooses the class. ``trainer_accelerator_class`` puts ``qaccel.Accelerator`` under that name while
   the parent method runs (under a lock, restored afterwards), so everything else the parent does
   (gradient accumulation plugin, dataloader config, FSDP/DeepSpeed flags and checks) stays its own.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from accelerate.utils import DistributedType

from ..fsdp import QSDPConfig
from ..optim import OneBitOptimizerBase
from ._qsdp import QSDPPlugin
from ._transformers_internals import redo_device_setup

__all__ = ["ensure_cpu_distributed", "check_combination", "qsdp_plugin_for", "onebit_clipping", "clipping_choice"]

logger = logging.getLogger(__name__)

# What TrainingArguments(fsdp=True) gives FSDP (transformer-block wrapping of the model's
# ``_no_split_modules``, a full state dict so ``save_model`` writes a normal model folder), each
# used only when Accelerate's own FSDP_* variable (set by ``accelerate launch``) does not say otherwise.
_FSDP_DEFAULTS = {
    "auto_wrap_policy": ("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP"),
    "state_dict_type": ("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT"),
}


def _world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def ensure_cpu_distributed(args: Any) -> bool:
    """Make a multi-process run without a GPU really distributed (gloo); True when it changed ``args``.

    Only acts when ``WORLD_SIZE > 1``, no CUDA device is visible, ``args.use_cpu`` is False and the
    set-up ``TrainingArguments`` already did left Accelerate with ``DistributedType.NO``.
    """
    if _world_size_from_env() <= 1 or torch.cuda.is_available() or args.use_cpu:
        return False
    state = getattr(args, "distributed_state", None)
    if state is None or state.distributed_type != DistributedType.NO or args.device.type != "cpu":
        return False
    args.use_cpu = True
    args.dataloader_pin_memory = False  # as TrainingArguments.__post_init__ does for use_cpu
    device = redo_device_setup(args)  # now with ``cpu=True``
    if args.distributed_state.distributed_type != DistributedType.MULTI_CPU:
        raise RuntimeError(
            f"qaccel.Trainer: WORLD_SIZE={_world_size_from_env()} without a GPU, but Accelerate set up "
            f"{args.distributed_state.distributed_type} even with use_cpu=True; this transformers/accelerate "
            "version changed how TrainingArguments sets up devices"
        )
    logger.warning(
        "qaccel.Trainer: WORLD_SIZE=%d and no GPU: using TrainingArguments(use_cpu=True), %d processes over %s on %s",
        _world_size_from_env(), args.world_size, args.distributed_state.backend, device,
    )  # fmt: skip
    return True


def check_combination(args: Any, qsdp: QSDPConfig | None, optimizer: torch.optim.Optimizer | None) -> None:
    """Refuse set-ups qaccel cannot run, before any model is wrapped.

    Raises:
        TypeError: ``qsdp`` is not a ``QSDPConfig``.
        ValueError: ``qsdp`` with DeepSpeed, with an FSDP1 ``fsdp_config`` or with a 1-bit optimizer;
            a 1-bit optimizer with FSDP or DeepSpeed.
    """
    if qsdp is not None and not isinstance(qsdp, QSDPConfig):
        raise TypeError(f"qaccel.Trainer: qsdp must be a qaccel.QSDPConfig or None, got {type(qsdp).__name__}")
    deepspeed = getattr(args, "deepspeed_plugin", None) is not None
    fsdp_args = getattr(args, "fsdp_plugin_args", None)
    onebit = isinstance(optimizer, OneBitOptimizerBase)
    name = type(optimizer).__name__
    if qsdp is not None:
        if deepspeed:
            raise ValueError(
                "qaccel.Trainer: qsdp= together with DeepSpeed (TrainingArguments.deepspeed or ACCELERATE_USE_DEEPSPEED): "
                "QSDP runs on FSDP2; drop one of them"
            )
        if fsdp_args is not None and str(fsdp_args.get("fsdp_version", 2)) != "2":
            raise ValueError(
                f"qaccel.Trainer: qsdp= with fsdp_config version={fsdp_args['fsdp_version']}: QSDP runs on FSDP2 only; "
                "set fsdp_config={'version': 2} (the default) or leave TrainingArguments.fsdp unset"
            )
        if onebit:
            raise ValueError(
                f"qaccel.Trainer: qsdp= together with the optimizer {name}: QSDP shards parameters (FSDP2) while "
                f"{name} needs full replicas under DDP; use one of them"
            )
    if onebit and (deepspeed or fsdp_args is not None):
        engine = "DeepSpeed" if deepspeed else "FSDP (TrainingArguments.fsdp)"
        raise ValueError(
            f"qaccel.Trainer: the optimizer {name} runs under DDP with full replicas, not under {engine}; unset it"
        )


def onebit_clipping(optimizer: OneBitOptimizerBase, max_grad_norm: float) -> None:
    """Hand ``TrainingArguments.max_grad_norm`` to a 1-bit optimizer, which then clips instead of the Trainer.

    The Trainer clips through ``accelerator.clip_grad_norm_``, which under DDP uses each rank's local
    norm; on steps whose gradients are not all-reduced the ranks would clip differently. The
    optimizer's ``gradient_clipping`` uses a norm that is the same on every rank. As with the Trainer's
    DeepSpeed integration, an unset (0) optimizer value takes ``max_grad_norm`` and two different
    non-zero values are an error.

    Raises:
        ValueError: both are set and differ.
    """
    own = optimizer.config.gradient_clipping
    if max_grad_norm is None or max_grad_norm <= 0 or own == max_grad_norm:
        return
    if own > 0:
        raise ValueError(
            f"qaccel.Trainer: TrainingArguments.max_grad_norm={max_grad_norm} but {type(optimizer).__name__} has "
            f"gradient_clipping={own}; the optimizer clips (with a rank-consistent norm), so set max_grad_norm={own} "
            "or max_grad_norm=0"
        )
    optimizer.set_gradient_clipping(float(max_grad_norm))


def _overlap_off_anyway(optimizer: OneBitOptimizerBase, args: Any) -> str | None:
    """Why the 1-bit all-reduce cannot overlap backward in this run whatever the clipping, or None.

    The set-up half of :meth:`OneBitOptimizerBase.overlap_blocker`, read from ``TrainingArguments``
    before the model is wrapped (the optimizer is not attached yet).
    """
    if not optimizer.config.overlap_comm:
        return "the optimizer has overlap_comm=False"
    if args.world_size <= 1:
        return "one process: there is no all-reduce"
    if args.device.type != "cpu":
        return f"overlap runs on CPU (gloo) only, this run is on {args.device.type}"
    if args.fp16:
        return "fp16 makes the ranks agree on overflow, and a skipped step must not have touched the state"
    return None


def clipping_choice(optimizer: OneBitOptimizerBase, args: Any) -> tuple[int, str]:
    """The logging level and message that say how ``optimizer`` clips in this run and what that does to the overlap.

    The optimizer's clipping norm (``docs/zero_one_adam.md``, "Clipping") covers the whole gradient,
    so it is known only when backward ends, after the overlapped all-reduce would have read the
    gradients; clipping therefore runs the 1-bit all-reduce after backward. No rule that keeps the
    overlap clips the step it is measured on with a rank-consistent norm (``docs/trainer.md``,
    "Clipping and overlap"). A WARNING when clipping is what switches the overlap off (fixed with
    ``max_grad_norm=0``), INFO otherwise.
    """
    name, clip, max_grad_norm = type(optimizer).__name__, optimizer.config.gradient_clipping, args.max_grad_norm
    blocker = _overlap_off_anyway(optimizer, args)
    if clip <= 0:
        what = f"qaccel.Trainer: {name} does not clip (max_grad_norm={max_grad_norm}, gradient_clipping=0)"
        if blocker is not None:
            return logging.INFO, f"{what}; its 1-bit all-reduce runs after backward ({blocker})"
        return logging.INFO, f"{what}, so its 1-bit all-reduce overlaps backward (overlap_comm)"
    own = clip != max_grad_norm  # the optimizer's own value, with max_grad_norm=0
    what = (
        f"qaccel.Trainer: {name} clips at {f'its own gradient_clipping={clip}' if own else f'max_grad_norm={clip}'} "
        "with a norm that is the same on every rank and known only after backward"
    )
    if blocker is not None:
        return logging.INFO, f"{what}; its 1-bit all-reduce runs after backward in this run anyway ({blocker})"
    fix = "build the optimizer with gradient_clipping=0" if own else "set max_grad_norm=0"
    return logging.WARNING, (
        f"{what}, so its 1-bit all-reduce runs after backward (no overlap with backward); {fix} to overlap it "
        "with backward, without clipping (docs/trainer.md, \"Clipping and overlap\")"
    )


def qsdp_plugin_for(args: Any, qsdp: QSDPConfig) -> QSDPPlugin:
    """The FSDP2 plugin for ``qsdp``: ``TrainingArguments``' FSDP settings where given, else the defaults above."""
    fsdp_kwargs = dict(getattr(args, "fsdp_plugin_args", None) or {})
    fsdp_kwargs.pop("fsdp_version", None)  # checked to be 2 by check_combination
    if not fsdp_kwargs:
        fsdp_kwargs = {key: default for key, (env, default) in _FSDP_DEFAULTS.items() if env not in os.environ}
    return QSDPPlugin(qsdp_config=qsdp, **fsdp_kwargs)

