"""The only layer that touches Accelerate and transformers internals."""

from typing import Any

from ._qsdp import QSDPPlugin
from .accelerator import Accelerator

__all__ = ["Accelerator", "QSDPPlugin", "Trainer"]


def __getattr__(name: str) -> Any:
    # Lazy: transformers' Trainer module takes seconds to import; only Trainer users pay for it.
    if name == "Trainer":
        from .trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'qaccel.integration' has no attribute {name!r}")
