"""qaccel: communication-efficient distributed training for Hugging Face Accelerate.

``from qaccel import Accelerator, QSDPPlugin`` is the one-line switch. The Accelerate-facing names
are imported lazily so that ``import qaccel.quant`` stays free of Accelerate and transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

from ._quiet_logs import quiet_unused_kernel_notices
from ._version import __version__

quiet_unused_kernel_notices()  # one bitsandbytes import-time notice; qaccel._quiet_logs says why

__all__ = ["__version__", "Accelerator", "QSDPPlugin", "QSDPConfig", "Trainer"]

_LAZY = {
    "Accelerator": "qaccel.integration",
    "QSDPPlugin": "qaccel.integration",
    "Trainer": "qaccel.integration",
    "QSDPConfig": "qaccel.fsdp",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'qaccel' has no attribute {name!r}")
