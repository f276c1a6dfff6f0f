"""The only layer that touches Accelerate and transformers internals."""

from ._qsdp import QSDPPlugin
from .accelerator import Accelerator

__all__ = ["Accelerator", "QSDPPlugin"]
