"""Suite-wide fixtures."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def _native_kernels_built_once():
    """Build the C++ codec kernels once, before any test spawns ranks.

    The build is cached on disk; without this, the first multi-process test would have every
    spawned rank wait on the same ~30 s build lock. A machine without a compiler simply gets the
    reference (the fallback is tested in tests/unit/test_quant_native.py).
    """
    from qaccel.quant import _native

    _native.try_load("cpu")
