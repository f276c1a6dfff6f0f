"""Load the native codec kernels: the only door of qaccel through which anything compiles.

Nothing happens at import. :func:`try_load` builds a backend's shared library on first use
(:mod:`qaccel.quant._native_build`: ``torch.utils.cpp_extension.load``, cached on disk under
``QACCEL_CACHE_DIR``) and caches the outcome in-process (``functools.cache``). Loading the library
registers its kernels for the ``CPU`` or ``CUDA`` dispatch key of the ops declared once in
:mod:`qaccel.quant._ops`; from then on ``torch.ops.qaccel.<op>`` runs them for that device's
tensors (eagerly, under ``FakeTensorMode`` and inside ``torch.compile``).

Each backend is returned as a module exposing exactly the functions of
:mod:`qaccel.quant.reference` (the wrappers of :mod:`qaccel.quant._ops`), with ``chunk_rms`` taken
from the reference (its norm must reduce in torch's order, as DeepSpeed's).
"""

from __future__ import annotations

import functools
import threading
from types import ModuleType

import torch

from . import _ops, reference
from ._cuda_toolchain import cuda_include_dir, find_nvcc, host_object_command, nvcc_object_command
from ._native_build import CACHE_ENV, CSRC, build_and_load, build_name, cache_root, toolchain_problem

__all__ = [
    "NATIVE_BACKENDS",
    "CACHE_ENV",
    "CSRC",
    "try_load",
    "load",
    "describe",
    "cache_root",
    "build_name",
    "find_nvcc",
    "cuda_include_dir",
    "nvcc_object_command",
    "host_object_command",
]

NATIVE_BACKENDS = ("cpu", "cuda")
_KERNEL_NAMES = tuple(_ops.SCHEMAS)
_outcomes: dict[str, tuple[bool, str | None]] = {}  # backend -> (loaded, reason) of try_load
_build_lock = threading.Lock()


@functools.cache
def try_load(backend: str) -> tuple[ModuleType | None, str | None]:
    """Build (first call) and load ``backend``; returns ``(kernels, None)`` or ``(None, reason)``.

    The outcome, failure included, is cached for the life of the process, so a failing build is
    attempted once.
    """
    if backend not in NATIVE_BACKENDS:
        raise ValueError(f"backend={backend!r}: must be one of {', '.join(NATIVE_BACKENDS)}")
    with _build_lock:  # one build per process even if threads race to the first codec call
        problem = toolchain_problem(backend)
        if problem is None:
            try:
                kernels = _kernels_module(backend, build_and_load(backend).stem)
            except Exception as error:  # compiler errors surface as RuntimeError, OSError, ImportError...
                message = " ".join(str(error).split())
                problem = f"build failed ({type(error).__name__}): {message[-1500:]}"
    _outcomes[backend] = (problem is None, problem)
    return (kernels, None) if problem is None else (None, problem)


def load(backend: str) -> ModuleType:
    """Return the kernels of ``backend``; raises RuntimeError with the reason if they cannot be built."""
    kernels, reason = try_load(backend)
    if kernels is None:
        raise RuntimeError(f"qaccel {backend} kernels unavailable: {reason}")
    return kernels


def describe(backend: str) -> dict:
    """Build name, folder and state of ``backend`` without building it."""
    info: dict = {"toolchain_problem": toolchain_problem(backend)}
    if backend == "cuda" and torch.version.cuda is None:
        info["built"] = False
        return info
    try:
        name = build_name(backend)
    except (RuntimeError, AssertionError) as error:  # e.g. no CUDA device to read the arch from
        info["built"] = False
        info["error"] = str(error)
        return info
    build_dir = cache_root() / name
    info.update(name=name, build_dir=str(build_dir), built=any(build_dir.glob(f"{name}*.so")))
    if backend in _outcomes:  # only report a load that already happened in this process
        info["loaded"], info["error"] = _outcomes[backend]
    return info


def _kernels_module(backend: str, library_name: str) -> ModuleType:
    """A module with the reference's function names and signatures over the ops, once ``backend`` is loaded.

    The functions dispatch on their tensors' device: the library just loaded serves ``backend``'s
    tensors, as the dispatcher routes them to its kernels.
    """
    kernels = ModuleType(f"qaccel.quant._native.{backend}")
    kernels.__doc__ = f"qaccel {backend} codec kernels ({library_name}, torch.ops.{_ops.NAMESPACE})"
    kernels.BACKEND = backend
    kernels.BUILD_NAME = library_name
    kernels.chunk_rms = reference.chunk_rms
    for name in _KERNEL_NAMES:
        setattr(kernels, name, getattr(_ops, name))
    return kernels
