"""QSDP wiring into Accelerate: the hooks ``qaccel.Accelerator`` calls around ``__init__`` and ``prepare``.

The plugin is :mod:`._qsdp_plugin`'s ``QSDPPlugin``, the auto-wrap plan :mod:`._fsdp2_auto_wrap`'s
and the checkpoint part :mod:`._qsdp_state`'s; all are re-exported here, where callers import them.

Order (``docs/qsdp.md``, "Accelerate"):

1. ``before_init``: pick the plugin (a ``QSDPPlugin``, or one built from ``QACCEL_*`` settings
   when ``accelerate launch`` asked for FSDP2) and hand Accelerate a *copy* of it, given
   ``param_dtype=bf16, reduce_dtype=fp32`` under bf16 mixed precision (the wire format is ours, so
   an fp32 reduce costs no bandwidth); ask for the CPU backend when a distributed run has no GPU,
   and hold back Accelerate's check of a ``ParallelismConfig`` (it refuses 2-D meshes on CPU runs).
   The caller's plugin object is never changed.
2. ``after_init``: on a multi-process CPU run, switch Accelerate to its FSDP2 path
   (:func:`qaccel.integration.cpu_fsdp.enable_fsdp2_on_cpu`), then run that check.
3. ``before_prepare``: for any FSDP2 plugin, settle the auto-wrap so that no unit nests around a
   module Accelerate shards on its own afterwards (:func:`plan_auto_wrap`); then refuse what QSDP
   cannot do, before any collective.
4. ``preparing``: around Accelerate's ``prepare``; under hierarchical QSDP (``dp_replicate_size``
   R > 1) Accelerate shards on the intra-node ``dp_shard_cp`` mesh instead of the 2-D one.
5. ``after_prepare``: install the comms on every FSDP2 unit of the prepared model (with the
   ``dp_replicate`` group as replica group under hierarchical QSDP, unless a 1-bit optimizer owns
   the replicas) and the step hook on the prepared optimizer(s); register the seed state for
   ``save_state``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from typing import Any

import torch
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from .._settings import env_flag
from ..fsdp import QSDPHandle, install_qsdp
from ..optim import OneBitOptimizerBase
from ._accelerate_internals import (
    REPLICATE_DIM,
    defer_parallelism_check,
    fsdp2_shards_within_nodes,
    run_deferred_parallelism_check,
)
from ._fsdp2_auto_wrap import plan_auto_wrap
from ._qsdp_plugin import QSDP_KEYWORDS, QSDPPlugin
from ._qsdp_state import read_qsdp_state, write_qsdp_state
from .cpu_fsdp import enable_fsdp2_on_cpu

__all__ = [
    "QSDPPlugin",
    "QSDP_KEYWORDS",
    "before_init",
    "after_init",
    "plan_auto_wrap",
    "before_prepare",
    "preparing",
    "after_prepare",
    "is_hierarchical",
    "write_qsdp_state",
    "read_qsdp_state",
]

logger = logging.getLogger(__name__)

_MP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _launched_with_fsdp2() -> bool:
    return env_flag("ACCELERATE_USE_FSDP") and os.environ.get("FSDP_VERSION", "1") == "2"


def _world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def before_init(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Adjust ``Accelerator.__init__`` keyword arguments for QSDP; returns a new dict."""
    kwargs = dict(kwargs)
    plugin = kwargs.get("fsdp_plugin")
    if plugin is None and _launched_with_fsdp2():
        # `accelerate launch` with an FSDP2 config and qaccel's Accelerator: QSDP from QACCEL_* settings.
        plugin = kwargs["fsdp_plugin"] = QSDPPlugin()
    if not isinstance(plugin, FullyShardedDataParallelPlugin) or plugin.fsdp_version != 2:
        return kwargs
    if isinstance(plugin, QSDPPlugin):
        # Accelerate (and enable_fsdp2_on_cpu) set attributes on the plugin they are given: give
        # them a copy, so the caller's object stays as the caller built it.
        plugin = kwargs["fsdp_plugin"] = copy.copy(plugin)
    if isinstance(plugin, QSDPPlugin) and plugin.mixed_precision_policy is None and plugin.qsdp_config.grad_bits is not None:
        mixed_precision = kwargs.get("mixed_precision") or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        mixed_precision = getattr(mixed_precision, "value", mixed_precision)
        if mixed_precision in _MP_DTYPES:
            dtype = _MP_DTYPES[mixed_precision]
            # Quantized gradients travel as our codes whatever reduce_dtype is, so reduce in fp32:
            # the codec then sees exact gradients, and FSDP2 divides the sum in fp32, at no
            # bandwidth cost (docs/qsdp.md, "Mixed precision").
            plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, output_dtype=dtype)
    if "cpu" not in kwargs and not torch.cuda.is_available() and _world_size_from_env() > 1:
        # Without a GPU Accelerate would run each process alone; the CPU backend gives gloo.
        kwargs["cpu"] = True
    if kwargs.get("cpu") and _world_size_from_env() > 1:
        parallelism = kwargs.get("parallelism_config")
        if parallelism is None and env_flag("ACCELERATE_USE_PARALLELISM_CONFIG"):
            parallelism = ParallelismConfig()  # what Accelerator.__init__ would build from PARALLELISM_CONFIG_*
        if parallelism is not None:
            # Accelerate checks the mesh against the run type inside __init__, where a CPU run is still
            # MULTI_CPU (refused); after_init checks it once the run is FSDP2.
            kwargs["parallelism_config"] = defer_parallelism_check(parallelism)
    return kwargs


def after_init(accelerator: Any, fsdp_plugin: Any = None) -> None:
    """On a multi-process CPU run with an FSDP2 plugin, switch Accelerate to its FSDP2 path."""
    plugin = fsdp_plugin
    if not isinstance(plugin, FullyShardedDataParallelPlugin) or plugin.fsdp_version != 2:
        return
    if accelerator.distributed_type == DistributedType.MULTI_CPU:
        enable_fsdp2_on_cpu(accelerator, plugin)
        run_deferred_parallelism_check(accelerator)
    elif accelerator.distributed_type == DistributedType.NO and isinstance(plugin, QSDPPlugin):
        logger.warning("QSDP: single process, nothing to communicate; QSDP is inactive")


def _fsdp2_plugin(accelerator: Any) -> FullyShardedDataParallelPlugin | None:
    if accelerator.distributed_type != DistributedType.FSDP:
        return None
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    return plugin if isinstance(plugin, FullyShardedDataParallelPlugin) and str(plugin.fsdp_version) == "2" else None


def _qsdp_plugin(accelerator: Any) -> QSDPPlugin | None:
    plugin = _fsdp2_plugin(accelerator)
    return plugin if isinstance(plugin, QSDPPlugin) else None


def before_prepare(accelerator: Any, args: tuple) -> None:
    """Settle the FSDP2 auto-wrap (any FSDP2 plugin); refuse unsupported QSDP set-ups before anything is sharded."""
    fsdp2_plugin = _fsdp2_plugin(accelerator)
    if fsdp2_plugin is not None:
        for model in args:
            if not isinstance(model, nn.Module) or isinstance(model, FSDPModule):
                continue
            dropped = plan_auto_wrap(fsdp2_plugin, model)
            if dropped and accelerator.is_main_process:
                logger.info(
                    "FSDP auto-wrap: left %s out of %s's _no_split_modules (each contains a module Accelerate shards "
                    "as its own unit: %s); units: %s", sorted(dropped), type(model).__name__, dropped,
                    fsdp2_plugin.transformer_cls_names_to_wrap,
                )  # fmt: skip
    plugin = _qsdp_plugin(accelerator)
    if plugin is None:
        return
    parallelism = getattr(accelerator, "parallelism_config", None)
    if parallelism is not None:
        others = {name: getattr(parallelism, name, 1) or 1 for name in ("tp_size", "cp_size", "sp_size")}
        if any(size > 1 for size in others.values()):
            listed = ", ".join(f"{name}={size}" for name, size in others.items() if size > 1)
            raise NotImplementedError(
                f"QSDP: parallelism_config {listed}: QSDP shards data-parallel meshes only, 1-D (dp_shard_size) or "
                "hierarchical 2-D (dp_replicate_size x dp_shard_size: sharded within a node, replicated across "
                "nodes); tensor, context and sequence parallelism are not supported. Set them to 1"
            )
    has_model = any(isinstance(obj, torch.nn.Module) for obj in args)
    has_optimizer = any(isinstance(obj, torch.optim.Optimizer) for obj in args)
    if has_model and not has_optimizer:
        raise ValueError("QSDP: pass the model and its optimizer to the same accelerator.prepare call (FSDP2 requires it)")


def is_hierarchical(accelerator: Any) -> bool:
    """QSDP with ``ParallelismConfig(dp_replicate_size=R > 1, dp_shard_size=S)``: hierarchical QSDP."""
    parallelism = getattr(accelerator, "parallelism_config", None)
    return _qsdp_plugin(accelerator) is not None and parallelism is not None and (parallelism.dp_replicate_size or 1) > 1


def preparing(accelerator: Any) -> contextlib.AbstractContextManager:
    """Context for Accelerate's ``prepare``: hierarchical QSDP shards on the intra-node mesh only."""
    return fsdp2_shards_within_nodes(accelerator) if is_hierarchical(accelerator) else contextlib.nullcontext()


def after_prepare(accelerator: Any, objects: list) -> None:
    """Install QSDP comms on the prepared FSDP2 model and hook the prepared optimizer(s)."""
    plugin = _qsdp_plugin(accelerator)
    if plugin is None:
        return
    models = [obj for obj in objects if isinstance(obj, FSDPModule)]
    if not models:
        return
    if len(models) > 1:
        raise NotImplementedError(f"QSDP: {len(models)} FSDP models in one prepare call; Accelerate's FSDP2 path takes one")
    optimizers = [obj.optimizer if isinstance(obj, AcceleratedOptimizer) else obj for obj in objects if isinstance(obj, (AcceleratedOptimizer, torch.optim.Optimizer))]
    # A 1-bit optimizer owns the traffic across replicas (qaccel.integration._zero_one_adam): QSDP then
    # runs inside the node only, and replica_grad_bits is not used.
    onebit = any(isinstance(opt, OneBitOptimizerBase) for opt in optimizers)
    replica_group = accelerator.torch_device_mesh[REPLICATE_DIM].get_group() if is_hierarchical(accelerator) and not onebit else None
    handle: QSDPHandle = install_qsdp(models[0], plugin.qsdp_config, optimizers=optimizers, meter=accelerator.wire_meter, replica_group=replica_group)
    accelerator.qsdp = handle
    # The seed counters drive the rounding noise; save_state/load_state carry them for exact
    # resumes. As JSON through the state hooks rather than register_for_checkpointing, whose
    # pickle Accelerate loads with weights_only=False: nothing is unpickled unsafely on resume.
    rank = accelerator.process_index
    accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: write_qsdp_state(handle, output_dir, rank, accelerator.is_main_process))
    accelerator.register_load_state_pre_hook(lambda models, input_dir: read_qsdp_state(handle, input_dir, rank))
    if accelerator.is_main_process:
        logger.info("QSDP config: %s; units: %s", plugin.qsdp_config.to_dict(), handle.describe())
