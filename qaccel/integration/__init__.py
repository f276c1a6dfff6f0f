"""The only layer that touches Accelerate and transformers internals."""

from .accelerator import Accelerator
from ._qsdp import QSDPPlugin

__all__ = ["Accelerator", "QSDPPlugin"]
