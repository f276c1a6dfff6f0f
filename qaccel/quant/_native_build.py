"""Compile and load one native codec library: build name, flags, toolchain checks, cache folder.

A library is built with :func:`torch.utils.cpp_extension.load` (``is_python_module=False``: it is a
plain shared library whose static initializers register its kernels for the ops declared in
:mod:`qaccel.quant._ops`; no pybind module) under ``QACCEL_CACHE_DIR`` (default:
``TORCH_EXTENSIONS_DIR`` or torch's extensions root). The build name is a hash of the sources, the op
schemas, the compiler, every flag, the Python, torch and CUDA versions and the CPU model, so a stale
or foreign build is never loaded; a cached build is loaded directly, skipping ninja.

Build flags keep the arithmetic of the specification: ``-O3`` but no fast-math, and no FMA
contraction (``-ffp-contract=off``, nvcc ``--fmad=false``), since a fused multiply-add rounds once
where the reference rounds twice. The C++ build uses ``-march=native`` (the build runs where it is
built, and the CPU model is part of the build name) and ``-fno-trapping-math``, which lets GCC
vectorize ``floor`` (it changes no rounded result, only what may be assumed about FP traps).

On Linux both libraries link the shared C++ runtime by its soname (``-l:libstdc++.so.6``), the one
torch and Python already have loaded. A compiler whose own library folder holds only the static
``libstdc++.a`` (seen on a GPU machine whose ``CXX`` was a GCC built under ``/opt/gcc``) otherwise
copies the runtime into the library; that second copy's locale is never set up, and the first error
message that formats a number (``bits=9: must be ...``) crashed the process instead of raising.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

from ._ops import SCHEMAS

__all__ = [
    "CACHE_ENV",
    "CSRC",
    "SOURCES",
    "HEADERS",
    "CXX_FLAGS",
    "NVCC_FLAGS",
    "LINUX_LD_FLAGS",
    "compiler",
    "link_flags",
    "cache_root",
    "build_name",
    "toolchain_problem",
    "build_and_load",
]

logger = logging.getLogger(__name__)

CACHE_ENV = "QACCEL_CACHE_DIR"
CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = {"cpu": ("quant_cpu.cpp",), "cuda": ("quant_cuda_binding.cpp", "quant_cuda.cu")}
HEADERS = ("quant_checks.h", "quant_common.h", "quant_cpu_avx512.h", "quant_cuda.h", "quant_cuda_device.cuh",
           "quant_onebit.h", "quant_ops.h", "quant_payload.h")  # fmt: skip
CXX_FLAGS = ("-O3", "-ffp-contract=off", "-fno-trapping-math", "-march=native")
# torch's own nvcc defines (COMMON_NVCC_FLAGS) are added by cpp_extension; ours keep the maths exact.
NVCC_FLAGS = ("-O3", "--fmad=false", "-Xcompiler", "-ffp-contract=off")
# The shared C++ runtime, never a static copy (module docstring); GNU ld and lld take -l:<file name>.
LINUX_LD_FLAGS = ("-l:libstdc++.so.6",)
_STALE_LOCK_SECONDS = 900


def compiler() -> str:
    """The host C++ compiler: ``$CXX`` or ``c++``, as cpp_extension picks it."""
    return os.environ.get("CXX", "c++")


def cache_root() -> Path:
    """Folder holding one sub-folder per build (``QACCEL_CACHE_DIR`` or torch's extensions root)."""
    explicit = os.environ.get(CACHE_ENV) or os.environ.get("TORCH_EXTENSIONS_DIR")
    if explicit:
        return Path(explicit).expanduser()
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def _cpu_model() -> str:
    # -march=native code must not load on another CPU sharing the cache (e.g. a network home).
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            lines = [line for line in info if line.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _cuda_arch_flags() -> list[str]:
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}"
    return [f"-gencode=arch=compute_{arch},code=sm_{arch}"]


def _flags(backend: str) -> tuple[list[str], list[str]]:
    """(C++ flags, nvcc flags) of one backend's build."""
    if backend == "cpu":
        return list(CXX_FLAGS), []
    return ["-O3", "-ffp-contract=off"], [*NVCC_FLAGS, *_cuda_arch_flags()]


def link_flags() -> list[str]:
    """Linker flags of both backends' libraries (the shared C++ runtime on Linux)."""
    return list(LINUX_LD_FLAGS) if sys.platform.startswith("linux") else []


def build_name(backend: str) -> str:
    """Library name: ``qaccel_quant_<backend>_<hash>`` over sources, op schemas, toolchain, flags and versions."""
    digest = hashlib.sha256()
    for name in (*SOURCES[backend], *HEADERS):
        digest.update(name.encode())
        digest.update((CSRC / name).read_bytes())
    # The kernels are checked against the schemas when the library loads: a schema change rebuilds.
    digest.update(repr(sorted(SCHEMAS.items())).encode())
    cxx_flags, nvcc_flags = _flags(backend)
    identity = [
        backend,
        torch.__version__,
        str(torch.version.cuda),
        sys.version,
        getattr(sys, "abiflags", ""),
        platform.machine(),
        compiler(),
        shutil.which(compiler()) or "",
        _cpu_model(),
        *cxx_flags,
        *nvcc_flags,
        *link_flags(),
    ]
    if backend == "cuda":
        from torch.utils.cpp_extension import CUDA_HOME

        identity.append(str(CUDA_HOME))
    digest.update("\0".join(identity).encode())
    return f"qaccel_quant_{backend}_{digest.hexdigest()[:16]}"


def toolchain_problem(backend: str) -> str | None:
    """Why ``backend`` cannot be built here, found without compiling (None if it may work)."""
    from torch.utils import cpp_extension

    if shutil.which(compiler()) is None:
        return f"no C++ compiler found (CXX={compiler()!r} is not on PATH)"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja); torch.utils.cpp_extension.load needs it"
    if backend == "cuda":
        if torch.version.cuda is None:
            return f"this torch build ({torch.__version__}) has no CUDA support"
        if not torch.cuda.is_available():
            return "no CUDA device is available"
        if cpp_extension.CUDA_HOME is None:
            return "nvcc/CUDA toolkit not found (set CUDA_HOME)"
    return None


def _clear_stale_lock(build_dir: Path) -> None:
    # torch's FileBaton waits forever on a lock left by a killed build; ours take well under a minute.
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > _STALE_LOCK_SECONDS:
        logger.warning("qaccel: removing a build lock left %.0f s ago by an interrupted build: %s", age, lock)
        lock.unlink(missing_ok=True)


def _load_built(library: Path) -> bool:
    """Load an already built library; False if there is none (or a build is under way)."""
    if not library.exists() or (library.parent / "lock").exists():
        return False
    torch.ops.load_library(str(library))
    return True


def build_and_load(backend: str) -> Path:
    """Load ``backend``'s library into the process, building it first if no cached build exists.

    Returns:
        The path of the loaded shared library; its kernels are registered with the dispatcher.

    Raises:
        RuntimeError, OSError, ImportError, ...: the compiler or the loader failed (callers report it).
    """
    from torch.utils import cpp_extension

    name = build_name(backend)
    build_dir = cache_root() / name
    library = build_dir / f"{name}.so"
    _clear_stale_lock(build_dir)
    try:
        if _load_built(library):
            return library
    except OSError as error:  # a damaged library: let ninja rebuild it
        logger.warning("qaccel: cached %s kernels at %s failed to load (%s); rebuilding", backend, build_dir, error)
    build_dir.mkdir(parents=True, exist_ok=True)
    logger.warning("qaccel: building the %s codec kernels in %s (first use; cached afterwards)", backend, build_dir)
    cxx_flags, nvcc_flags = _flags(backend)
    loaded = cpp_extension.load(
        name=name,
        sources=[str(CSRC / source) for source in SOURCES[backend]],
        extra_cflags=cxx_flags,
        extra_cuda_cflags=nvcc_flags,
        extra_ldflags=link_flags(),
        extra_include_paths=[str(CSRC)],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )
    return Path(loaded)
