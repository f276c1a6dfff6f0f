"""The CUDA toolkit as the compile check sees it: nvcc, its include folder, object-file commands.

``tests/unit/test_cuda_compile.py`` compiles the CUDA backend to object files on machines without a
GPU (nothing links or runs): nvcc builds ``quant_cuda.cu`` with the JIT build's flags, the host
compiler builds the torch layer (``quant_cuda_binding.cpp``, which holds the CUDA op registration)
against the installed torch headers.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

from ._native_build import CSRC, NVCC_FLAGS, compiler

__all__ = ["find_nvcc", "cuda_include_dir", "nvcc_object_command", "host_object_command"]

_TORCH_NVCC_DEFINES = (
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
)


def find_nvcc() -> str | None:
    """Path of nvcc: ``$CUDA_HOME/bin/nvcc`` as torch finds it, else the one on PATH, else None."""
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME:
        candidate = Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc"
        if candidate.exists():
            return str(candidate)
    return shutil.which("nvcc")


def cuda_include_dir(nvcc: str) -> str | None:
    """The toolkit folder holding ``cuda_runtime_api.h`` for ``nvcc`` (None if not found).

    Looks next to ``CUDA_HOME``/``CUDA_PATH`` and the resolved nvcc, then asks nvcc itself
    (``--dryrun`` prints its include path), since nvcc may be a wrapper script elsewhere.
    """
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), Path(nvcc).resolve().parent.parent]
    for root in filter(None, candidates):
        include = Path(root) / "include"
        if (include / "cuda_runtime_api.h").exists():
            return str(include)
    try:
        dryrun = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull], capture_output=True, text=True,
                                timeout=60, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    for folder in re.findall(r'INCLUDES="-I([^"]+)"', dryrun.stdout + dryrun.stderr):
        if (Path(folder) / "cuda_runtime_api.h").exists():
            return str(Path(folder).resolve())
    return None


def nvcc_object_command(output: str | os.PathLike, nvcc: str, arch_flags: list[str] | None = None) -> list[str]:
    """nvcc command compiling ``quant_cuda.cu`` to an object file with the JIT build's flags.

    Torch's include folders are passed as in the JIT build although the kernels need none of them
    (the .cu is standalone by design; see its header comment).
    """
    from torch.utils import cpp_extension

    includes = [f"-I{CSRC}", *(f"-I{path}" for path in cpp_extension.include_paths())]
    return [
        nvcc, "-c", str(CSRC / "quant_cuda.cu"), "-o", str(output), "-std=c++20", "-Xcompiler", "-fPIC",
        *_TORCH_NVCC_DEFINES, *NVCC_FLAGS, *(arch_flags or []), *includes,
    ]  # fmt: skip


def host_object_command(output: str | os.PathLike, cuda_include: str) -> list[str]:
    """C++ command compiling the CUDA backend's torch binding and op registration to an object file (no GPU needed)."""
    from torch.utils import cpp_extension

    includes = [f"-I{CSRC}", *(f"-isystem{path}" for path in cpp_extension.include_paths())]
    includes += [f"-isystem{sysconfig.get_path('include')}", f"-isystem{cuda_include}"]
    return [
        compiler(), "-c", str(CSRC / "quant_cuda_binding.cpp"), "-o", str(output), "-std=c++20", "-fPIC", "-O1",
        "-DTORCH_EXTENSION_NAME=qaccel_quant_cuda_compile_check", "-DTORCH_API_INCLUDE_EXTENSION_H", *includes,
    ]  # fmt: skip
