"""Fixtures shared by the unit tests."""

import pytest

from qaccel.quant import _native


@pytest.fixture(scope="module")
def cpu_kernels():
    """The C++ codec kernels (skipped only where no compiler exists; a failed build fails the test)."""
    problem = _native.describe("cpu")["toolchain_problem"]
    if problem is not None:
        pytest.skip(f"C++ kernels cannot be built on this machine: {problem}")
    kernels, reason = _native.try_load("cpu")
    assert kernels is not None, f"the C++ kernels failed to build: {reason}"
    return kernels
