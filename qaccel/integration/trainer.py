"""``qaccel.Trainer``: a drop-in ``transformers.Trainer`` that trains with QSDP or 0/1 Adam / 1-bit Adam.

The Trainer builds a :class:`qaccel.Accelerator` instead of ``accelerate.Accelerator``
(:mod:`qaccel.integration._trainer_setup` says how), so the QSDP comms and the 1-bit DDP hook are
installed inside the Trainer's own ``accelerator.prepare`` call, exactly as for a hand-written loop.
On top of the parent it adds wire bytes to every log entry, qaccel's state to every checkpoint, and
the clipping rule of 1-bit optimizers. Where that needs the Trainer's private methods, the
``_qaccel_*`` hooks of :class:`~qaccel.integration._transformers_internals.TrainerHooks` are used:
that module holds every private transformers name and the versions it was checked against.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
import transformers

from ..comm import WireMeter
from ..fsdp import QSDPConfig
from ..optim import OneBitOptimizerBase
from . import _trainer_checkpoint, _trainer_setup
from ._trainer_logging import WireLog, WireStepCallback
from ._transformers_internals import TrainerHooks, check_trainer_internals, trainer_accelerator_class
from .accelerator import Accelerator

__all__ = ["Trainer"]

logger = logging.getLogger(__name__)

_PARENT_SIGNATURE = inspect.signature(transformers.Trainer.__init__)


class Trainer(TrainerHooks):
    """``transformers.Trainer`` with quantized FSDP2 (QSDP) or 0/1 Adam / 1-bit Adam on DDP.

    Args:
        *args, **kwargs: as for ``transformers.Trainer``.
        qsdp: train with QSDP under FSDP2. FSDP settings come from ``TrainingArguments``
            (``fsdp=True`` / ``fsdp_config``, version 2) where given, else the blocks named in the
            model's ``_no_split_modules`` become FSDP units and checkpoints hold full state dicts.
        wire_meter: where qaccel's collectives count bytes (default: a new meter for this Trainer).

    A qaccel :class:`~qaccel.optim.ZeroOneAdam` or :class:`~qaccel.optim.OneBitAdam` passed in
    ``optimizers=(opt, None)`` (or built from ``optimizer_cls_and_kwargs``) trains under DDP with its
    communication hook; it clips gradients itself, at ``TrainingArguments.max_grad_norm`` unless it
    was given its own ``gradient_clipping``. Clipping needs the norm of the whole gradient, known only
    after backward, so it runs the 1-bit all-reduce after backward instead of overlapping it
    (``overlap_comm``); ``max_grad_norm=0`` keeps the overlap, without clipping. Rank 0 logs once
    which of the two the run uses (a warning when clipping is what turns the overlap off).

    On a multi-process run without a GPU (``torchrun`` on CPUs) ``TrainingArguments`` is switched to
    ``use_cpu=True``, so the processes train together over gloo.

    Log entries gain ``wire_bytes`` (bytes this rank sent since the previous entry),
    ``wire_bytes/<kind>`` (the same per collective kind that sent any) and ``wire_bytes_total``.
    See ``docs/trainer.md``.

    Raises:
        ValueError: ``qsdp`` with DeepSpeed, an FSDP1 ``fsdp_config`` or a 1-bit optimizer; a 1-bit
            optimizer with FSDP or DeepSpeed; ``max_grad_norm`` and the optimizer's
            ``gradient_clipping`` both set and different.

    Example::

        trainer = qaccel.Trainer(model=model, args=TrainingArguments("out", max_steps=100),
                                 train_dataset=data, qsdp=QSDPConfig(weight_bits=8, grad_bits=8))
        trainer.train()
    """

    def __init__(
        self, *args: Any, qsdp: QSDPConfig | None = None, wire_meter: WireMeter | None = None, **kwargs: Any
    ) -> None:
        check_trainer_internals()  # first: a transformers release without them fails here, with its version
        arguments = _PARENT_SIGNATURE.bind_partial(None, *args, **kwargs).arguments
        arguments.pop("self")
        if arguments.get("args") is None:  # the parent's default, built here so it can be checked first
            arguments["args"] = transformers.TrainingArguments(output_dir="tmp_trainer")
        optimizer = (arguments.get("optimizers") or (None, None))[0]
        _trainer_setup.check_combination(arguments["args"], qsdp, optimizer)
        _trainer_setup.ensure_cpu_distributed(arguments["args"])
        # Read by the overrides below, which the parent's __init__ already calls.
        self._qaccel_qsdp = qsdp
        self._qaccel_meter = wire_meter if wire_meter is not None else WireMeter()
        self._qaccel_wire_log = WireLog(self._qaccel_meter)
        self._qaccel_clipping_logged = False
        super().__init__(**arguments)
        self.add_callback(WireStepCallback(self._qaccel_meter))
        if isinstance(self.optimizer, OneBitOptimizerBase):
            _trainer_setup.onebit_clipping(self.optimizer, self.args.max_grad_norm)
            self._log_clipping_choice(self.optimizer)

    # ---------------------------------------------------------------------------------- set-up
    def create_accelerator_and_postprocess(self) -> None:
        """The parent's set-up, with a ``qaccel.Accelerator`` in place of ``accelerate.Accelerator``."""

        def build(**kwargs: Any) -> Accelerator:
            return Accelerator(wire_meter=self._qaccel_meter, **kwargs)

        with trainer_accelerator_class(build):
            super().create_accelerator_and_postprocess()
        if not isinstance(self.accelerator, Accelerator):
            raise RuntimeError(
                "qaccel.Trainer: the parent built its Accelerator elsewhere; this transformers version is not supported"
            )

    def _qaccel_accelerator_args(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        if self._qaccel_qsdp is not None:
            kwargs["fsdp_plugin"] = _trainer_setup.qsdp_plugin_for(self.args, self._qaccel_qsdp)
        return kwargs

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(model)
        if isinstance(optimizer, OneBitOptimizerBase):  # also one built from optimizer_cls_and_kwargs
            _trainer_setup.check_combination(self.args, self._qaccel_qsdp, optimizer)
            _trainer_setup.onebit_clipping(optimizer, self.args.max_grad_norm)
            self._log_clipping_choice(optimizer)
        return optimizer

    # -------------------------------------------------------------------------------- clipping
    def _onebit_optimizer(self) -> OneBitOptimizerBase | None:
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # inside an AcceleratedOptimizer
        return optimizer if isinstance(optimizer, OneBitOptimizerBase) else None

    def _log_clipping_choice(self, optimizer: OneBitOptimizerBase) -> None:
        # Once per Trainer (create_optimizer runs again for an optimizer given to __init__), on rank 0:
        # the choice is the same on every rank.
        if self._qaccel_clipping_logged:
            return
        self._qaccel_clipping_logged = True
        if self.is_world_process_zero():
            level, message = _trainer_setup.clipping_choice(optimizer, self.args)
            logger.log(level, message)

    def _qaccel_optimizer_clips(self) -> bool:
        # A 1-bit optimizer clips in step(), with a norm that is the same on every rank; the Trainer's
        # local norm would be rank-dependent, so log() reports the optimizer's own.
        return self._onebit_optimizer() is not None

    # --------------------------------------------------------------------------------- logging
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The parent's log, plus wire bytes (and a 1-bit optimizer's clipping norm as ``grad_norm``)."""
        onebit = self._onebit_optimizer()
        if onebit is not None and "loss" in logs and "grad_norm" not in logs and onebit.last_grad_norm is not None:
            logs["grad_norm"] = onebit.last_grad_norm
        logs.update(self._qaccel_wire_log.entries())
        super().log(logs, start_time)

    # ----------------------------------------------------------------------------- checkpoints
    def _qaccel_saved_optimizer(self, output_dir: str) -> None:
        _trainer_checkpoint.save_qaccel_state(self.accelerator, output_dir)

    def _qaccel_loading_optimizer(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            _trainer_checkpoint.stage_onebit_state(self.accelerator, checkpoint)

    def _qaccel_loaded_optimizer(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            _trainer_checkpoint.load_qsdp_state(self.accelerator, checkpoint)
