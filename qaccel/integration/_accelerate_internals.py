"""The one module that reads Accelerate's private surface (style guide §9).

Checked against accelerate 1.15.0 (:data:`ACCELERATE`). What is read, and why no public API does it:

- ``Accelerator._optimizers``: every optimizer ``prepare`` returned, across all ``prepare`` calls
  (``accelerator.py``). A model and its optimizer may be prepared in different calls, and 0/1 Adam's
  DDP hook needs both, so :func:`prepared_optimizers` looks at all of them.
- Not an attribute but a behaviour: which modules ``fsdp2_prepare_model`` shards on their own after
  the auto-wrap (:func:`fsdp2_carved_out_modules`, mirroring its rule and its private
  ``_find_final_norm``), so that qaccel's wrap never nests a unit around one of them.

A name an Accelerate release dropped raises a ``RuntimeError`` naming it, the installed version and
the checked ones.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .._upstream import PrivateSurface

__all__ = ["ACCELERATE", "fsdp2_carved_out_modules", "prepared_optimizers"]

ACCELERATE = PrivateSurface("accelerate", ("1.15.0",), __name__)


def prepared_optimizers(accelerator: Any) -> list[Any]:
    """The ``AcceleratedOptimizer`` objects of every ``prepare`` call so far, in preparation order.

    Raises:
        RuntimeError: this Accelerate keeps no ``Accelerator._optimizers``.
    """
    purpose = "finding a prepared 1-bit optimizer and its DDP model across prepare calls"
    return list(ACCELERATE.get(accelerator, "_optimizers", purpose, owner="Accelerator"))


def fsdp2_carved_out_modules(model: nn.Module) -> list[nn.Module]:
    """The modules Accelerate's FSDP2 preparation shards as units of their own after the auto-wrap.

    Mirrors accelerate 1.15 ``utils/fsdp_utils.py`` ``fsdp2_prepare_model``: after the auto-wrap it
    calls ``fully_shard`` on the input embedding (unless tied to the output embedding), then on one
    group of [final norm, (input embedding,) output embedding], skipping modules that are units
    already. The final norm is the last direct child of the base model whose class name contains
    ``"Norm"`` (``_find_final_norm``).
    """
    carved = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(model, getter, lambda: None)()
        except NotImplementedError:  # a transformers model without that embedding
            module = None
        if isinstance(module, nn.Module):
            carved.append(module)
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else model
    if isinstance(base, nn.Module):
        norms = [child for child in base.children() if "Norm" in type(child).__name__]
        carved.extend(norms[-1:])
    return [module for module in carved if module is not model]
