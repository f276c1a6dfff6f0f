"""The one module that touches transformers' private surface (style guide §9).

Checked against transformers 5.24.0 (:data:`TRANSFORMERS`). ``qaccel.Trainer`` changes what the
Trainer does at five points that have no public hook, all private methods of
``transformers.Trainer`` (``trainer.py``); :class:`TrainerHooks` overrides exactly those and hands
each to a named ``_qaccel_*`` hook that ``qaccel.Trainer`` implements:

- ``_build_accelerator_args(**kwargs)``: the keyword arguments of the Trainer's Accelerator
  (``_qaccel_accelerator_args``: the QSDP plugin goes in here);
- ``_clip_grad_norm(model)`` / ``_get_grad_norm(model, grad_norm)``: skipped when the optimizer clips
  itself (``_qaccel_optimizer_clips``), since a DDP rank's local norm differs across ranks;
- ``_save_optimizer_and_scheduler(output_dir)`` / ``_load_optimizer_and_scheduler(checkpoint)``:
  qaccel's own state next to the optimizer's (``_qaccel_saved_optimizer``,
  ``_qaccel_loading_optimizer``, ``_qaccel_loaded_optimizer``).

A method renamed upstream would leave its override silently uncalled, so
:func:`check_trainer_internals` (run first by ``qaccel.Trainer.__init__``) checks every name and
parameter list, and raises one message with the installed and the checked versions. The same
holds for the two other internals the Trainer relies on: the module-level name ``Accelerator`` in
``transformers.trainer`` (:func:`trainer_accelerator_class`) and the cached ``_setup_devices`` of
``TrainingArguments`` (:func:`redo_device_setup`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import transformers
import transformers.trainer as hf_trainer

from .._upstream import PrivateSurface

__all__ = ["TRANSFORMERS", "TrainerHooks", "check_trainer_internals", "trainer_accelerator_class", "redo_device_setup"]

TRANSFORMERS = PrivateSurface("transformers", ("5.24.0",), __name__)

# Private Trainer methods TrainerHooks overrides -> their parameters after ``self`` in the checked versions.
TRAINER_OVERRIDES = {
    "_build_accelerator_args": ("kwargs",),
    "_clip_grad_norm": ("model",),
    "_get_grad_norm": ("model", "grad_norm"),
    "_save_optimizer_and_scheduler": ("output_dir",),
    "_load_optimizer_and_scheduler": ("checkpoint",),
}
_OVERRIDE_PURPOSE = "qaccel.Trainer changes the Trainer's behaviour there"
_ACCELERATOR_PURPOSE = "qaccel.Trainer builds a qaccel.Accelerator through this name"
_DEVICES_PURPOSE = "qaccel.Trainer redoes the device set-up with use_cpu=True on a multi-process CPU run"

_SWAP_LOCK = threading.Lock()


def check_trainer_internals() -> None:
    """Check every transformers internal ``qaccel.Trainer`` relies on; call before building one.

    Raises:
        RuntimeError: an overridden method is gone or takes other parameters, ``transformers.trainer``
            no longer has the name ``Accelerator``, or ``TrainingArguments._setup_devices`` is no
            longer a cached property; the message names the installed and the checked versions.
    """
    for name, parameters in TRAINER_OVERRIDES.items():
        TRANSFORMERS.require_method(transformers.Trainer, name, parameters, _OVERRIDE_PURPOSE)
    TRANSFORMERS.get(hf_trainer, "Accelerator", _ACCELERATOR_PURPOSE)
    _setup_devices_property()


def _setup_devices_property() -> None:
    attribute = inspect.getattr_static(transformers.TrainingArguments, "_setup_devices", None)
    if not isinstance(attribute, functools.cached_property):
        raise TRANSFORMERS.missing("TrainingArguments._setup_devices (a functools.cached_property)", _DEVICES_PURPOSE)


def redo_device_setup(args: transformers.TrainingArguments) -> torch.device:
    """Run ``TrainingArguments``' device and Accelerate-state set-up again, with the current ``args``.

    ``_setup_devices`` is a ``cached_property``: dropping its cached value makes the next
    ``args.device`` run it again (it resets Accelerate's state and reuses the process group).

    Returns:
        ``args.device`` after the new set-up.

    Raises:
        RuntimeError: ``_setup_devices`` is no longer a cached property.
    """
    _setup_devices_property()
    args.__dict__.pop("_setup_devices", None)
    return args.device


@contextlib.contextmanager
def trainer_accelerator_class(factory: Callable[..., Any]) -> Iterator[None]:
    """While active, ``transformers.trainer.Accelerator(**kwargs)`` calls ``factory(**kwargs)``.

    ``Trainer.create_accelerator_and_postprocess`` builds ``Accelerator(**args)`` through the name
    imported at the top of ``transformers.trainer``; no argument or method chooses the class. The
    name is swapped under a lock and restored afterwards, so everything else the parent does stays
    its own.

    Raises:
        RuntimeError: ``transformers.trainer`` no longer has the name ``Accelerator``.
    """
    with _SWAP_LOCK:
        original = TRANSFORMERS.get(hf_trainer, "Accelerator", _ACCELERATOR_PURPOSE)
        hf_trainer.Accelerator = factory
        try:
            yield
        finally:
            hf_trainer.Accelerator = original


class TrainerHooks(transformers.Trainer):
    """``transformers.Trainer`` with its private methods that qaccel changes forwarded to ``_qaccel_*`` hooks.

    The defaults of the hooks keep the parent's behaviour; ``qaccel.Trainer`` overrides them.
    """

    # ------------------------------------------------------------------------------------- hooks
    def _qaccel_accelerator_args(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Keyword arguments for the Trainer's Accelerator, before the parent adds its own."""
        return kwargs

    def _qaccel_optimizer_clips(self) -> bool:
        """True when the optimizer clips gradients itself (the Trainer then neither clips nor measures)."""
        return False

    def _qaccel_saved_optimizer(self, output_dir: str) -> None:
        """Called on every rank after the parent saved the optimizer and scheduler to ``output_dir``."""

    def _qaccel_loading_optimizer(self, checkpoint: str | None) -> None:
        """Called before the parent loads the optimizer and scheduler from ``checkpoint`` (None: no resume)."""

    def _qaccel_loaded_optimizer(self, checkpoint: str | None) -> None:
        """Called after the parent loaded the optimizer and scheduler from ``checkpoint`` (None: no resume)."""

    # ------------------------------------------------------------- transformers private methods
    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        return super()._build_accelerator_args(**self._qaccel_accelerator_args(kwargs))

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        if self._qaccel_optimizer_clips():
            return None
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        if self._qaccel_optimizer_clips():
            return None
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        self._qaccel_saved_optimizer(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        self._qaccel_loading_optimizer(checkpoint)
        super()._load_optimizer_and_scheduler(checkpoint)
        self._qaccel_loaded_optimizer(checkpoint)
