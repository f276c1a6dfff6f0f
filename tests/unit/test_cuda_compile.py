"""The CUDA backend compiles here without a GPU (object files only, no link, nothing runs).

``quant_cuda.cu`` holds the kernels and host launchers and needs only the CUDA toolkit: nvcc
compiles it for a generic architecture (nvcc's default) with the JIT build's flags.
``quant_cuda_binding.cpp`` is the torch layer, which also registers the CUDA kernels of the codec ops
(``TORCH_LIBRARY_IMPL(qaccel, CUDA, m)`` with the op list of ``quant_ops.h``): the host compiler
builds it against the installed torch headers and the toolkit's ``cuda_runtime_api.h``. Running the kernels and checking them bit for
bit against the reference on a GPU is ``scripts/gpu_check.sh``'s job.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from qaccel.quant import _native

NVCC = _native.find_nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc (CUDA toolkit) not found: set CUDA_HOME or put nvcc on PATH")


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.slow
def test_cuda_kernels_compile_with_nvcc(tmp_path):
    obj = tmp_path / "quant_cuda.o"
    result = _run(_native.nvcc_object_command(obj, NVCC))
    assert result.returncode == 0, result.stderr[-4000:]
    assert obj.stat().st_size > 0
    assert "warning" not in result.stderr.lower(), result.stderr[-4000:]
    if shutil.which("nm"):
        symbols = _run(["nm", "-C", str(obj)]).stdout
        for launcher in ("qaccel_cuda::quantize(", "qaccel_cuda::dequantize(", "qaccel_cuda::sign_pack(",
                         "qaccel_cuda::sign_unpack(", "qaccel_cuda::encode_payloads(", "qaccel_cuda::decode_payloads(",
                         "qaccel_cuda::sum_payloads("):  # fmt: skip
            assert launcher in symbols, launcher


@pytest.mark.slow
def test_cuda_binding_compiles_against_torch_headers(tmp_path):
    compiler = shutil.which(_native.host_object_command(tmp_path / "x.o", "")[0])
    if compiler is None:
        pytest.skip("no host C++ compiler (CXX) to compile the torch binding")
    include = _native.cuda_include_dir(NVCC)
    assert include is not None, f"cuda_runtime_api.h not found for {NVCC}"
    obj = tmp_path / "quant_cuda_binding.o"
    result = _run(_native.host_object_command(obj, include))
    assert result.returncode == 0, result.stderr[-4000:]
    assert obj.stat().st_size > 0
    if shutil.which("nm"):  # the registration is compiled in: its static initializer is in the object
        symbols = _run(["nm", "-C", str(obj)]).stdout
        assert "TORCH_LIBRARY_IMPL_static_init_qaccel_CUDA" in symbols
        assert "PyInit" not in symbols  # a plain library of op kernels, no Python module
