"""Choice of the kernel backend for each codec call.

``QACCEL_KERNELS`` selects it: ``auto`` (default: the native kernel of the tensor's device, falling
back to the reference with one warning when it cannot be built), ``reference``, ``cpu`` or
``cuda`` (explicit: a failure to build raises). Every backend exposes the functions of
:mod:`qaccel.quant.reference` with the same signatures and bit-identical results.

The native kernels are built on first use by :mod:`qaccel.quant._native` (never at import), so the
first codec call of a process may take a minute once per machine; later processes load the cached
build in milliseconds.
"""

from __future__ import annotations

import logging
import os
import warnings
from types import ModuleType

import torch

from . import _native, reference

__all__ = ["BACKENDS", "ENV_NAME", "requested_backend", "kernels_for", "status", "available_kernels"]

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "reference", "cpu", "cuda")
ENV_NAME = "QACCEL_KERNELS"
_NATIVE_FOR_DEVICE = {"cpu": "cpu", "cuda": "cuda"}
_warned: set[str] = set()


def requested_backend() -> str:
    """Return the validated value of ``QACCEL_KERNELS`` (default ``auto``)."""
    value = os.environ.get(ENV_NAME, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"{ENV_NAME}={value!r}: must be one of {', '.join(BACKENDS)}")
    return value


def _warn_fallback_once(backend: str, reason: str) -> None:
    if backend in _warned:
        return
    _warned.add(backend)
    message = (
        f"qaccel: the {backend} codec kernels are unavailable ({reason}); using the pure-torch reference "
        f"codec (same results, slower). Set {ENV_NAME}=reference to silence this warning."
    )
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def kernels_for(device: torch.device | str) -> ModuleType:
    """Return the module implementing the codec kernels for tensors on ``device``.

    Args:
        device: the device of the tensors the kernels will read and write.

    Returns:
        :mod:`qaccel.quant.reference` or a native kernel module with the same functions.

    Raises:
        ValueError: ``QACCEL_KERNELS`` is not a known backend, or names a backend of another
            device type (``cpu`` for a CUDA tensor, ``cuda`` for a CPU tensor).
        RuntimeError: the explicitly requested native backend cannot be built or loaded.
    """
    requested = requested_backend()
    if requested == "reference":
        return reference
    device_type = torch.device(device).type
    native = _NATIVE_FOR_DEVICE.get(device_type)
    if requested == "auto":
        if native is None:  # e.g. meta or mps tensors: only the reference runs there
            return reference
        kernels, reason = _native.try_load(native)
        if kernels is None:
            _warn_fallback_once(native, reason)
            return reference
        return kernels
    if native != requested:
        allowed = ", ".join(name for name in ("auto", "reference", native) if name)
        raise ValueError(
            f"{ENV_NAME}={requested}: the {requested} kernels cannot run on a {device_type} tensor; "
            f"allowed for this device: {allowed}"
        )
    return _native.load(requested)


def status(build: bool = False) -> dict:
    """Which backends exist and whether each is built, for ``qaccel env``.

    Args:
        build: try to build (or load) every native backend this machine could run first, so the
            report says whether it works and, if not, why.

    Returns:
        ``{"requested", "cache_dir", "reference": {...}, "cpu": {...}, "cuda": {...}}``; a native
        entry holds ``available`` (toolchain present), ``built`` (a cached build exists),
        ``name``/``build_dir``, and ``loaded``/``error`` once a load was attempted.
    """
    try:
        requested = requested_backend()
    except ValueError as error:
        requested = f"invalid: {error}"
    report: dict = {
        "requested": requested,
        "cache_dir": str(_native.cache_root()),
        "reference": {"available": True, "built": True},
    }
    for backend in _native.NATIVE_BACKENDS:
        if build and _native.describe(backend)["toolchain_problem"] is None:
            _native.try_load(backend)
        info = _native.describe(backend)
        problem = info.pop("toolchain_problem")
        info["available"] = problem is None
        if problem is not None:
            info["reason"] = problem
        if backend == "cuda":
            info["nvcc"] = _native.find_nvcc()
        report[backend] = info
    return report


def available_kernels(device: torch.device | str) -> dict[str, ModuleType]:
    """Every backend usable for ``device`` right now, by name (the reference always).

    Honours ``QACCEL_KERNELS``: ``reference`` lists only the reference; an explicit native backend
    that fails raises as in :func:`kernels_for`; under ``auto`` a failed build warns once and is left
    out.
    """
    backends: dict[str, ModuleType] = {"reference": reference}
    requested = requested_backend()
    native = _NATIVE_FOR_DEVICE.get(torch.device(device).type)
    if requested == "reference" or native is None:
        return backends
    if requested == "auto":
        kernels, reason = _native.try_load(native)
        if kernels is None:
            _warn_fallback_once(native, reason)
            return backends
        backends[native] = kernels
        return backends
    backends[native] = kernels_for(device)
    return backends
