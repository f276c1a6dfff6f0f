"""Build and load the native codec kernels: the only module of qaccel that compiles anything.

Nothing happens at import. :func:`try_load` builds a backend on first use with
:func:`torch.utils.cpp_extension.load` and caches the result in-process (``functools.cache``)
and on disk, under ``QACCEL_CACHE_DIR`` (default: ``TORCH_EXTENSIONS_DIR`` or torch's default
extensions root). The build name is a hash of the sources, the compiler, every flag, the Python,
torch and CUDA versions and the CPU model, so a stale or foreign build is never loaded; a cached
build is imported directly, skipping ninja. Each backend is returned as a module exposing exactly
the functions of :mod:`qaccel.quant.reference`, with ``chunk_rms`` taken from the reference (its
norm must reduce in torch's order, as DeepSpeed's).

Build flags keep the arithmetic of the specification: ``-O3`` but no fast-math, and no FMA
contraction (``-ffp-contract=off``, nvcc ``--fmad=false``), since a fused multiply-add rounds once
where the reference rounds twice. The C++ build uses ``-march=native`` (the build runs where it is
built, and the CPU model is part of the build name) and ``-fno-trapping-math``, which lets GCC
vectorize ``floor`` (it changes no rounded result, only what may be assumed about FP traps).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

from . import reference
from ._rng import normalize_seed

__all__ = [
    "NATIVE_BACKENDS",
    "CACHE_ENV",
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

logger = logging.getLogger(__name__)

NATIVE_BACKENDS = ("cpu", "cuda")
CACHE_ENV = "QACCEL_CACHE_DIR"
CSRC = Path(__file__).resolve().parent.parent / "csrc"
_SOURCES = {"cpu": ("quant_cpu.cpp",), "cuda": ("quant_cuda_binding.cpp", "quant_cuda.cu")}
_HEADERS = ("quant_checks.h", "quant_common.h", "quant_cpu_avx512.h", "quant_cuda.h", "quant_cuda_device.cuh", "quant_payload.h")
_outcomes: dict[str, tuple[bool, str | None]] = {}  # backend -> (loaded, reason) of try_load
_build_lock = threading.Lock()
_STALE_LOCK_SECONDS = 900
_CXX_FLAGS = ("-O3", "-ffp-contract=off", "-fno-trapping-math", "-march=native")
# torch's own nvcc defines (COMMON_NVCC_FLAGS) are added by cpp_extension; ours keep the maths exact.
_NVCC_FLAGS = ("-O3", "--fmad=false", "-Xcompiler", "-ffp-contract=off")
_TORCH_NVCC_DEFINES = (
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
)


def cache_root() -> Path:
    """Folder holding one sub-folder per build (``QACCEL_CACHE_DIR`` or torch's extensions root)."""
    explicit = os.environ.get(CACHE_ENV) or os.environ.get("TORCH_EXTENSIONS_DIR")
    if explicit:
        return Path(explicit).expanduser()
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


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
        return list(_CXX_FLAGS), []
    return ["-O3", "-ffp-contract=off"], [*_NVCC_FLAGS, *_cuda_arch_flags()]


def build_name(backend: str) -> str:
    """Extension name: ``qaccel_quant_<backend>_<hash>`` over sources, toolchain, flags and versions."""
    digest = hashlib.sha256()
    for name in (*_SOURCES[backend], *_HEADERS):
        digest.update(name.encode())
        digest.update((CSRC / name).read_bytes())
    cxx_flags, nvcc_flags = _flags(backend)
    identity = [
        backend,
        torch.__version__,
        str(torch.version.cuda),
        sys.version,
        getattr(sys, "abiflags", ""),
        platform.machine(),
        _compiler(),
        shutil.which(_compiler()) or "",
        _cpu_model(),
        *cxx_flags,
        *nvcc_flags,
    ]
    if backend == "cuda":
        from torch.utils.cpp_extension import CUDA_HOME

        identity.append(str(CUDA_HOME))
    digest.update("\0".join(identity).encode())
    return f"qaccel_quant_{backend}_{digest.hexdigest()[:16]}"


def _build_dir(backend: str) -> Path:
    return cache_root() / build_name(backend)


def _toolchain_problem(backend: str) -> str | None:
    """Why ``backend`` cannot be built here, found without compiling (None if it may work)."""
    from torch.utils import cpp_extension

    if shutil.which(_compiler()) is None:
        return f"no C++ compiler found (CXX={_compiler()!r} is not on PATH)"
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


def _import_built(name: str, build_dir: Path) -> ModuleType | None:
    """Import an already built extension, or None if there is none (or a build is under way)."""
    library = build_dir / f"{name}.so"
    if not library.exists() or (build_dir / "lock").exists():
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(backend: str) -> ModuleType:
    from torch.utils import cpp_extension

    name = build_name(backend)
    build_dir = _build_dir(backend)
    _clear_stale_lock(build_dir)
    try:
        module = _import_built(name, build_dir)
    except ImportError as error:  # a damaged library: let ninja rebuild it
        logger.warning("qaccel: cached %s kernels at %s failed to import (%s); rebuilding", backend, build_dir, error)
        module = None
    if module is not None:
        return module
    build_dir.mkdir(parents=True, exist_ok=True)
    logger.warning("qaccel: building the %s codec kernels in %s (first use; cached afterwards)", backend, build_dir)
    cxx_flags, nvcc_flags = _flags(backend)
    return cpp_extension.load(
        name=name,
        sources=[str(CSRC / source) for source in _SOURCES[backend]],
        extra_cflags=cxx_flags,
        extra_cuda_cflags=nvcc_flags,
        extra_include_paths=[str(CSRC)],
        build_directory=str(build_dir),
        verbose=False,
    )


@functools.cache
def try_load(backend: str) -> tuple[ModuleType | None, str | None]:
    """Build (first call) and load ``backend``; returns ``(kernels, None)`` or ``(None, reason)``.

    The outcome, failure included, is cached for the life of the process, so a failing build is
    attempted once.
    """
    if backend not in NATIVE_BACKENDS:
        raise ValueError(f"backend={backend!r}: must be one of {', '.join(NATIVE_BACKENDS)}")
    with _build_lock:  # one build per process even if threads race to the first codec call
        problem = _toolchain_problem(backend)
        if problem is None:
            try:
                kernels = _wrap(backend, _build(backend))
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
    info: dict = {"toolchain_problem": _toolchain_problem(backend)}
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


def _wrap(backend: str, extension: ModuleType) -> ModuleType:
    """A module with the reference's function names and signatures over the compiled extension."""
    kernels = ModuleType(f"qaccel.quant._native.{backend}")
    kernels.__doc__ = f"qaccel {backend} codec kernels ({extension.__name__})"
    kernels.BACKEND = backend
    kernels.BUILD_NAME = extension.__name__
    kernels.chunk_rms = reference.chunk_rms
    if backend == "cuda":
        _bind_cuda(kernels, extension)
    else:
        _bind_cpu(kernels, extension)
    return kernels


def _flat(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1)
    return flat if flat.is_contiguous() else flat.contiguous()


def _is_bf16_meta(meta_dtype: torch.dtype) -> bool:
    if meta_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"meta_dtype={meta_dtype}: must be torch.float32 or torch.bfloat16")
    return meta_dtype == torch.bfloat16


def _bind_cpu(kernels: ModuleType, extension: ModuleType) -> None:
    def quantize_buckets(x, bits, bucket_size, nearest, seed, meta_dtype):
        codes, lo, scale = extension.quantize_buckets(
            _flat(x), bits, bucket_size, bool(nearest), normalize_seed(seed), _is_bf16_meta(meta_dtype)
        )
        return codes, lo, scale

    def dequantize_into(codes, lo, scale, bits, bucket_size, out, accumulate):
        return extension.dequantize_into(codes, lo, scale, bits, bucket_size, out, bool(accumulate))

    def sign_pack(x, chunks):
        return extension.sign_pack(_flat(x), chunks)

    def sign_unpack(signs, scales, numel, out):
        return extension.sign_unpack(signs, scales, numel, out)

    def encode_payloads(src, spec, src_offsets, seeds, out):
        return extension.encode_payloads(src, spec.table("cpu"), _offsets_tensor(src_offsets), seeds, out)

    def decode_payloads(blob, spec, out, out_offsets, seeds=None):
        return extension.decode_payloads(blob, spec.table("cpu"), out, _offsets_tensor(out_offsets), _seeds_or_empty(seeds))

    def sum_payloads(blob, spec, base, out, seeds=None):
        return extension.sum_payloads(blob, spec.table("cpu"), base, out, _seeds_or_empty(seeds))

    _install(kernels, quantize_buckets, dequantize_into, sign_pack, sign_unpack, encode_payloads, decode_payloads,
             sum_payloads)  # fmt: skip


def _bind_cuda(kernels: ModuleType, extension: ModuleType) -> None:
    # The binding takes the stream handle: the device guard and current stream come from torch here.
    def _stream(device: torch.device) -> int:
        return torch.cuda.current_stream(device).cuda_stream

    def quantize_buckets(x, bits, bucket_size, nearest, seed, meta_dtype):
        flat = _flat(x)
        with torch.cuda.device(flat.device):
            codes, lo, scale = extension.quantize_buckets(
                flat, bits, bucket_size, bool(nearest), normalize_seed(seed), _is_bf16_meta(meta_dtype),
                _stream(flat.device),
            )
        return codes, lo, scale

    def dequantize_into(codes, lo, scale, bits, bucket_size, out, accumulate):
        with torch.cuda.device(out.device):
            return extension.dequantize_into(codes, lo, scale, bits, bucket_size, out, bool(accumulate), _stream(out.device))

    def sign_pack(x, chunks):
        flat = _flat(x)
        with torch.cuda.device(flat.device):
            return extension.sign_pack(flat, chunks, _stream(flat.device))

    def sign_unpack(signs, scales, numel, out):
        with torch.cuda.device(out.device):
            return extension.sign_unpack(signs, scales, numel, out, _stream(out.device))

    # The fused calls read the layout table from device memory (copied once per spec and device) and
    # one small per-call slot table: [slots, 1 + segments] = chunk offset, then the segment seeds.
    def encode_payloads(src, spec, src_offsets, seeds, out):
        with torch.cuda.device(src.device):
            offsets = _offsets_tensor(src_offsets).view(-1, 1)
            if seeds.device.type == "cpu":
                slot_info = torch.cat([offsets, seeds], dim=1).to(src.device)
            else:
                slot_info = torch.cat([offsets.to(src.device), seeds], dim=1)
            return extension.encode_payloads(src, spec.table("cpu"), spec.table(src.device), slot_info, out,
                                             _stream(src.device))  # fmt: skip

    # seeds: the encode's [slots, segments] table, read only by a rotated spec (its rotation signs).
    def decode_payloads(blob, spec, out, out_offsets, seeds=None):
        with torch.cuda.device(out.device):
            offsets = _offsets_tensor(out_offsets).to(out.device)
            return extension.decode_payloads(blob, spec.table("cpu"), spec.table(out.device), out, offsets,
                                             _seeds_or_empty(seeds, out.device), _stream(out.device))  # fmt: skip

    def sum_payloads(blob, spec, base, out, seeds=None):
        with torch.cuda.device(out.device):
            return extension.sum_payloads(blob, spec.table("cpu"), spec.table(out.device), base, out,
                                          _seeds_or_empty(seeds, out.device), _stream(out.device))  # fmt: skip

    _install(kernels, quantize_buckets, dequantize_into, sign_pack, sign_unpack, encode_payloads, decode_payloads,
             sum_payloads)  # fmt: skip


def _seeds_or_empty(seeds: torch.Tensor | None, device: torch.device | str = "cpu") -> torch.Tensor:
    """The decode seed table for a kernel: ``[slots, segments]`` int64, or an empty one when unrotated."""
    if seeds is None:
        return torch.empty((0, 0), dtype=torch.int64, device=device)
    return seeds.to(device=device, dtype=torch.int64).contiguous()


def _offsets_tensor(offsets) -> torch.Tensor:
    """Per-slot element offsets as a CPU int64 tensor (the fused payload calls take a list or a tensor)."""
    if isinstance(offsets, torch.Tensor):
        return offsets.detach().to("cpu", torch.int64).reshape(-1).contiguous()
    return torch.tensor(list(offsets), dtype=torch.int64)


def _install(kernels: ModuleType, *functions) -> None:
    for function in functions:
        reference_function = getattr(reference, function.__name__)
        function.__doc__ = reference_function.__doc__
        function.__qualname__ = f"{kernels.BACKEND}.{function.__name__}"
        function.__annotations__ = dict(reference_function.__annotations__)
        setattr(kernels, function.__name__, function)


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
        *_TORCH_NVCC_DEFINES, *_NVCC_FLAGS, *(arch_flags or []), *includes,
    ]  # fmt: skip


def host_object_command(output: str | os.PathLike, cuda_include: str) -> list[str]:
    """C++ command compiling the CUDA backend's torch binding to an object file (no GPU needed)."""
    from torch.utils import cpp_extension

    includes = [f"-I{CSRC}", *(f"-isystem{path}" for path in cpp_extension.include_paths())]
    includes += [f"-isystem{sysconfig.get_path('include')}", f"-isystem{cuda_include}"]
    return [
        _compiler(), "-c", str(CSRC / "quant_cuda_binding.cpp"), "-o", str(output), "-std=c++20", "-fPIC", "-O1",
        "-DTORCH_EXTENSION_NAME=qaccel_quant_cuda_compile_check", "-DTORCH_API_INCLUDE_EXTENSION_H", *includes,
    ]  # fmt: skip
