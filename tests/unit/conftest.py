"""Fixtures shared by the unit tests."""

import pytest

from qaccel.quant import _native


def _built_kernels(backend: str, name: str, where: str):
    """``backend``'s codec kernels: skipped only where no toolchain exists; a failed build fails the test."""
    problem = _native.describe(backend)["toolchain_problem"]
    if problem is not None:
        pytest.skip(f"{name} kernels cannot be built {where}: {problem}")
    kernels, reason = _native.try_load(backend)
    assert kernels is not None, f"the {name} kernels failed to build: {reason}"
    return kernels


@pytest.fixture(scope="module")
def cpu_kernels():
    """The C++ codec kernels."""
    return _built_kernels("cpu", "C++", "on this machine")


@pytest.fixture(scope="module")
def cuda_kernels():
    """The CUDA codec kernels (tests that use them also skip where no CUDA device is present)."""
    return _built_kernels("cuda", "CUDA", "here")
