"""Choice of the kernel backend for each codec call.

``QACCEL_KERNELS`` selects it: ``auto`` (default: the native kernel of the tensor's device, falling
back to the reference with one warning when it cannot be built), ``reference``, ``cpu`` or
``cuda`` (explicit: a failure to build raises). Every backend exposes the functions of
:mod:`qaccel.quant.reference` with the same signatures and bit-identical results.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from . import reference

__all__ = ["BACKENDS", "requested_backend", "kernels_for"]

BACKENDS = ("auto", "reference", "cpu", "cuda")
ENV_NAME = "QACCEL_KERNELS"


def requested_backend() -> str:
    """Return the validated value of ``QACCEL_KERNELS`` (default ``auto``)."""
    value = os.environ.get(ENV_NAME, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"{ENV_NAME}={value!r}: must be one of {', '.join(BACKENDS)}")
    return value


def kernels_for(device: torch.device) -> ModuleType:
    """Return the module implementing the codec kernels for tensors on ``device``."""
    requested = requested_backend()
    if requested in ("auto", "reference"):
        return reference
    raise RuntimeError(f"{ENV_NAME}={requested}: native kernels are not available in this build")


def status(build: bool = False) -> dict:
    """Which backends exist and whether each is built (``build=True`` tries to build them)."""
    return {"requested": requested_backend(), "reference": {"available": True}}


def available_kernels(device: torch.device) -> dict[str, ModuleType]:
    """Every backend usable for ``device`` right now, by name (the reference always)."""
    return {"reference": reference}
