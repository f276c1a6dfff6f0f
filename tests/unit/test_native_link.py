"""The C++ kernels link the shared C++ runtime, also with a compiler that would link it statically.

On the GPU machine, ``CXX`` was a GCC under ``/opt/gcc`` whose library folder held only
``libstdc++.a``: the library got its own copy of the runtime, and the first error message that
formatted a number segfaulted the process (here, with ``-static-libstdc++``, the number is silently
dropped from the message instead). The reference is the message the C++ code writes, checked in a
fresh process against a library built by such a compiler, and the library's dynamic dependencies.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qaccel.quant import _native_build

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the soname link flag is for Linux")

_PROBE = """
import torch
from qaccel.quant import _native
kernels, why = _native.try_load("cpu")
assert kernels is not None, why
try:
    kernels.quantize_buckets(torch.randn(256), 9, 128, False, 1, torch.float32)
except RuntimeError as error:
    print(str(error).splitlines()[0])
"""


def test_a_compiler_that_links_the_runtime_statically_still_gives_whole_error_messages(tmp_path):
    if _native_build.toolchain_problem("cpu") is not None or shutil.which("c++") is None:
        pytest.skip(f"the C++ kernels do not build here: {_native_build.toolchain_problem('cpu')}")
    compiler = tmp_path / "bin" / "g++"  # named g++ so that torch does not warn about an unknown compiler
    compiler.parent.mkdir()
    # -O0 after the build's -O3: the link is what is tested, and an unoptimized compile takes a fraction of the time
    compiler.write_text(f'#!/bin/sh\nexec {shutil.which("c++")} "$@" -O0 -static-libstdc++\n')
    compiler.chmod(0o755)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QACCEL_")}
    environ.update(CXX=str(compiler), QACCEL_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    probe = subprocess.run([sys.executable, "-c", _PROBE], env=environ, capture_output=True, text=True, timeout=600)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert probe.stdout.strip() == "bits=9: must be an int in [2, 8]"
    (library,) = Path(tmp_path / "cache").glob("qaccel_quant_cpu_*/*.so")
    if shutil.which("ldd"):
        linked = subprocess.run(["ldd", str(library)], capture_output=True, text=True, check=True).stdout
        assert "libstdc++.so.6" in linked
