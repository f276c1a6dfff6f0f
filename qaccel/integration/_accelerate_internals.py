"""The one module that reads Accelerate's private surface (style guide §9).

Checked against accelerate 1.15.0 and 1.16.0 (:data:`ACCELERATE`; 1.16 changed none of what is read here:
its ``fsdp2_prepare_model`` gained ``ignored_params`` and skips the inner module of a checkpoint wrapper, and
the carve-out of embeddings and final norm, ``_find_final_norm``, ``_optimizers``, ``fsdp_dim_names`` and
``_validate_accelerator`` are as in 1.15). What is read, and why no public API does it:

- ``Accelerator._optimizers``: every optimizer ``prepare`` returned, across all ``prepare`` calls
  (``accelerator.py``). A model and its optimizer may be prepared in different calls, and 0/1 Adam's
  DDP hook needs both, so :func:`prepared_optimizers` looks at all of them. ``save_state`` and
  ``load_state`` write and read every optimizer in that list with Accelerate's own code; a 1-bit
  optimizer on HSDP shards keeps a different state on every rank, which Accelerate's FSDP path
  (``get_optimizer_state_dict``, one copy per shard) cannot hold, so :func:`optimizers_left_out`
  takes it out of the list for the duration of the call and qaccel writes it per rank.
- Not an attribute but a behaviour: which modules ``fsdp2_prepare_model`` shards on their own after
  the auto-wrap (:func:`fsdp2_carved_out_modules`, mirroring its rule and its private
  ``_find_final_norm``), so that qaccel's wrap never nests a unit around one of them.
- ``ParallelismConfig._validate_accelerator``: ``Accelerator.__init__`` calls it before qaccel can
  switch a CPU run to FSDP2, and it refuses a 2-D mesh on ``MULTI_CPU``; :func:`defer_parallelism_check`
  runs it once the switch is made instead (:func:`run_deferred_parallelism_check`).
- ``ParallelismConfig.fsdp_dim_names``: the mesh dimensions ``fsdp2_prepare_model`` passes to
  ``fully_shard`` (``mesh[tuple(fsdp_dim_names)]``); hierarchical QSDP shards on the intra-node
  dimension only (:func:`fsdp2_shards_within_nodes`) and all-reduces across replicas itself.

A name an Accelerate release dropped raises a ``RuntimeError`` naming it, the installed version and
the checked ones.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from accelerate.parallelism_config import ParallelismConfig
from torch import nn

from .._upstream import PrivateSurface

__all__ = [
    "ACCELERATE",
    "fsdp2_carved_out_modules",
    "prepared_optimizers",
    "optimizers_left_out",
    "defer_parallelism_check",
    "run_deferred_parallelism_check",
    "fsdp2_shards_within_nodes",
    "SHARD_DIM",
    "REPLICATE_DIM",
]

ACCELERATE = PrivateSurface("accelerate", ("1.15.0", "1.16.0"), __name__)


def prepared_optimizers(accelerator: Any) -> list[Any]:
    """The ``AcceleratedOptimizer`` objects of every ``prepare`` call so far, in preparation order.

    Raises:
        RuntimeError: this Accelerate keeps no ``Accelerator._optimizers``.
    """
    purpose = "finding a prepared 1-bit optimizer and its DDP model across prepare calls"
    return list(ACCELERATE.get(accelerator, "_optimizers", purpose, owner="Accelerator"))


@contextmanager
def optimizers_left_out(accelerator: Any, left_out: list[Any]) -> Iterator[None]:
    """Within the block, ``Accelerator._optimizers`` lacks ``left_out`` (``save_state`` / ``load_state`` skip them).

    The list is restored afterwards, also when the block raises.
    """
    purpose = "saving a sharded 1-bit optimizer per rank instead of through Accelerate's FSDP optimizer path"
    everything = ACCELERATE.get(accelerator, "_optimizers", purpose, owner="Accelerator")  # restored as the same list
    if not left_out:
        yield
        return
    ACCELERATE.set(accelerator, "_optimizers", [opt for opt in everything if all(opt is not out for out in left_out)], purpose, owner="Accelerator")
    try:
        yield
    finally:
        ACCELERATE.set(accelerator, "_optimizers", everything, purpose, owner="Accelerator")


def fsdp2_carved_out_modules(model: nn.Module) -> list[nn.Module]:
    """The modules Accelerate's FSDP2 preparation shards as units of their own after the auto-wrap.

    Mirrors accelerate 1.15/1.16 ``utils/fsdp_utils.py`` ``fsdp2_prepare_model``: after the auto-wrap it
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


SHARD_DIM = "dp_shard_cp"  # the mesh dimension Accelerate's FSDP2 shards over (dp_shard, flattened with cp)
REPLICATE_DIM = "dp_replicate"
_CHECK = "_validate_accelerator"


def defer_parallelism_check(config: ParallelismConfig) -> ParallelismConfig:
    """A copy of ``config`` whose check ``Accelerator.__init__`` skips; :func:`run_deferred_parallelism_check` runs it.

    The caller's object is left as it is.
    """
    ACCELERATE.get(ParallelismConfig, _CHECK, "checking a parallelism config after a CPU run switched to FSDP2")
    deferred = copy.copy(config)
    setattr(deferred, _CHECK, lambda accelerator: None)  # an instance attribute shadows the method
    return deferred


def run_deferred_parallelism_check(accelerator: Any) -> None:
    """Run the check :func:`defer_parallelism_check` held back, now that the run is FSDP2 (no-op otherwise)."""
    config = getattr(accelerator, "parallelism_config", None)
    if config is not None and _CHECK in vars(config):
        delattr(config, _CHECK)
        getattr(config, _CHECK)(accelerator)


class _ShardDimOnly(ParallelismConfig):
    """``fsdp_dim_names`` without the replicate dimension: Accelerate then shards on the intra-node mesh."""

    @property
    def fsdp_dim_names(self) -> list[str]:
        return [SHARD_DIM]


@contextmanager
def fsdp2_shards_within_nodes(accelerator: Any) -> Iterator[None]:
    """While active, Accelerate's FSDP2 preparation calls ``fully_shard`` on the 1-D ``dp_shard_cp`` mesh.

    Accelerate reads ``accelerator.parallelism_config.fsdp_dim_names`` (``fsdp2_prepare_model``); the
    state's config is swapped for a copy that names the shard dimension only, and put back after.
    """
    state = accelerator.state
    original = ACCELERATE.get(state, "parallelism_config", "sharding HSDP units on the intra-node mesh", owner="AcceleratorState")
    ACCELERATE.get(type(original), "fsdp_dim_names", "sharding HSDP units on the intra-node mesh", owner="ParallelismConfig")
    shard_only = copy.copy(original)
    shard_only.__class__ = _ShardDimOnly
    state.parallelism_config = shard_only
    try:
        yield
    finally:
        state.parallelism_config = original
