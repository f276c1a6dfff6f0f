"""0/1 Adam and 1-bit Adam under Accelerate (DDP, or HSDP shards): comm hook, process groups, per-rank checkpoint files.

``after_prepare`` runs at the end of every ``qaccel.Accelerator.prepare``. Once the prepared optimizer
wraps a qaccel 1-bit optimizer and the DDP model holding its parameters is prepared (same or a later
``prepare`` call), it:

1. installs the comm hook on the DDP model (``docs/accelerate.md``, "The DDP comm hook": Accelerate's
   ``DDPCommunicationHookType`` is a closed enum, so the hook is registered by hand; keep
   ``DistributedDataParallelKwargs.comm_hook`` at NO, DDP accepts one hook), with the fp16 overflow
   agreement when Accelerate uses a ``GradScaler``;
2. points the optimizer at the DDP process group and the accelerator's wire meter;
3. registers save/load-state pre-hooks: Accelerate writes ``optimizer.bin`` from the main process only
   (``checkpointing.py`` ``save_accelerator_state``), so every rank also writes its private state to
   ``qaccel_zoadam_rank{r}.pt`` (atomically) and stages it again before Accelerate loads the optimizer.

With one process there is no DDP model; the optimizer runs with world size 1 (1-bit all-reduce = identity).

**On HSDP shards** (FSDP2 with a ``QSDPPlugin`` and ``ParallelismConfig(dp_replicate_size=R >= 2,
dp_shard_size=S)``, ``docs/zero_one_adam.md``, "Sharded parameters (HSDP)"): ``before_prepare`` refuses
what cannot work before anything is sharded; QSDP shards within a node and leaves the replica group to
the optimizer (``qaccel.integration._qsdp``); ``after_prepare`` installs
:func:`qaccel.optim.register_hsdp_comm_hook` on the prepared model. Every rank's state is then its own,
which Accelerate's FSDP optimizer checkpoint (one copy per shard) cannot hold: ``qaccel.Accelerator``'s
``save_state`` / ``load_state`` leave the optimizer out of Accelerate's list
(:func:`state_saved_per_rank`), every rank writes its complete state to its rank file, and
:func:`after_load_state` restores it once Accelerate has loaded the model (whose file holds one replica's
weights; between syncs each replica's own come from its rank file).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from ..checkpoint import atomic_torch_save, load_torch_file, onebit_rank_path
from ..optim import OneBitOptimizerBase, register_ddp_comm_hook, register_hsdp_comm_hook
from ._accelerate_internals import REPLICATE_DIM, optimizers_left_out, prepared_optimizers
from ._qsdp import QSDPPlugin, is_hierarchical

__all__ = ["before_prepare", "after_prepare", "state_saved_per_rank", "after_load_state"]

logger = logging.getLogger(__name__)

_UNSUPPORTED = {
    DistributedType.DEEPSPEED: "DeepSpeed brings its own engine (use DeepSpeed's ZeroOneAdam there)",
    DistributedType.MEGATRON_LM: "Megatron-LM brings its own engine",
}


def _onebit_optimizers(accelerator: Any) -> list[OneBitOptimizerBase]:
    # A model and its optimizer may come from different prepare calls, so look at all of them, not only
    # this call's objects.
    # During save_state / load_state a sharded one is out of Accelerate's list (state_saved_per_rank).
    prepared = prepared_optimizers(accelerator) + getattr(accelerator, "_qaccel_left_out", [])
    return [opt.optimizer for opt in prepared if isinstance(opt, AcceleratedOptimizer) and isinstance(opt.optimizer, OneBitOptimizerBase)]


def _ddp_model_for(accelerator: Any, optimizer: OneBitOptimizerBase) -> DistributedDataParallel | None:
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
    for model in getattr(accelerator, "_qaccel_ddp_models", []):
        if wanted <= {id(p) for p in model.parameters()}:
            return model
    return None


def before_prepare(accelerator: Any, args: tuple) -> None:
    """Refuse a 1-bit optimizer on FSDP unless it can run on HSDP shards; nothing is sharded yet."""
    optimizers = [obj for obj in args if isinstance(obj, OneBitOptimizerBase)]
    if not optimizers or accelerator.distributed_type != DistributedType.FSDP:
        return
    name = type(optimizers[0]).__name__
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if not isinstance(plugin, QSDPPlugin):
        raise NotImplementedError(
            f"{name} on FSDP: runs on HSDP shards with a qaccel.QSDPPlugin (its intra-node codecs may be off: "
            f"QSDPPlugin(weight_bits='off', grad_bits='off')); got {type(plugin).__name__}, whose 2-D mesh would all-reduce "
            "every gradient across nodes in full precision"
        )
    if not is_hierarchical(accelerator):
        raise NotImplementedError(
            f"{name} on FSDP: needs ParallelismConfig(dp_replicate_size=R >= 2, dp_shard_size=S) (HSDP: sharded within a "
            "node, replicated across nodes); it compresses and skips the all-reduce across replicas, and a 1-D FSDP mesh "
            "has none. Use DDP (the shipped launch config cpu_2proc_ddp) or an HSDP launch (cpu_2x2_hqsdp; `qaccel configs --path NAME` "
            "prints its file)"
        )


def after_prepare(accelerator: Any, objects: list) -> None:
    """Wire a prepared ZeroOneAdam / OneBitAdam to the prepared DDP (or HSDP) model and to checkpointing."""
    # Accelerate's ``_models`` holds the unwrapped module, not the DDP wrapper it returns: remember the
    # wrappers of every prepare call, since the optimizer may be prepared in another call.
    ddp_models = [obj for obj in objects if isinstance(obj, DistributedDataParallel)]
    if ddp_models:
        accelerator._qaccel_ddp_models = getattr(accelerator, "_qaccel_ddp_models", []) + ddp_models
    optimizers = _onebit_optimizers(accelerator)
    if not optimizers:
        return
    reason = _UNSUPPORTED.get(accelerator.distributed_type)
    if reason is not None:
        raise NotImplementedError(
            f"{type(optimizers[0]).__name__} needs full replicas under DDP; distributed_type="
            f"{accelerator.distributed_type.value} is not supported: {reason}"
        )
    if len(optimizers) > 1:
        raise NotImplementedError(f"{len(optimizers)} qaccel 1-bit optimizers prepared; one per Accelerator is supported")
    optimizer = optimizers[0]
    optimizer.wire_meter = accelerator.wire_meter
    fsdp_models = [obj for obj in objects if isinstance(obj, FSDPModule)]
    if accelerator.distributed_type == DistributedType.FSDP:
        if fsdp_models and not optimizer.comm_hook_installed:
            replica_group = accelerator.torch_device_mesh[REPLICATE_DIM].get_group()
            register_hsdp_comm_hook(fsdp_models[0], optimizer, replica_group=replica_group, wire_meter=accelerator.wire_meter)
    elif accelerator.num_processes > 1:
        optimizer.require_comm_hook()
        model = _ddp_model_for(accelerator, optimizer)
        if model is not None and not optimizer.comm_hook_installed:
            register_ddp_comm_hook(
                model, optimizer, wire_meter=accelerator.wire_meter, agree_on_overflow=accelerator.scaler is not None
            )
    if not getattr(accelerator, "_qaccel_onebit_hooks", False):
        accelerator.register_save_state_pre_hook(_save_hook(accelerator))
        accelerator.register_load_state_pre_hook(_load_hook(accelerator))
        accelerator._qaccel_onebit_hooks = True
        if accelerator.is_main_process:
            logger.info("%s config: %s", type(optimizer).__name__, optimizer.config.to_dict())


def _save_hook(accelerator: Any):
    def save(models: list, weights: list, output_dir: str) -> None:
        for optimizer in _onebit_optimizers(accelerator):
            atomic_torch_save(optimizer.rank_state_dict(), onebit_rank_path(output_dir, accelerator.process_index))

    return save


def _sharded_optimizers(accelerator: Any) -> list[AcceleratedOptimizer]:
    return [opt for opt in prepared_optimizers(accelerator) if isinstance(opt, AcceleratedOptimizer) and getattr(opt.optimizer, "is_sharded", False)]


@contextlib.contextmanager
def state_saved_per_rank(accelerator: Any) -> Iterator[None]:
    """Around Accelerate's ``save_state`` / ``load_state``: a sharded 1-bit optimizer is left to the rank files."""
    left_out = _sharded_optimizers(accelerator)
    accelerator._qaccel_left_out = left_out  # the save/load pre-hooks still write and read them
    try:
        with optimizers_left_out(accelerator, left_out):
            yield
    finally:
        accelerator._qaccel_left_out = []


def after_load_state(accelerator: Any) -> None:
    """After Accelerate's ``load_state`` (the model is loaded): restore each sharded 1-bit optimizer from its rank file."""
    pending, accelerator._qaccel_sharded_payloads = getattr(accelerator, "_qaccel_sharded_payloads", []), []
    for optimizer, payload in pending:
        optimizer.load_rank_state(payload)


def _ranks_missing(have_file: bool) -> list[int]:
    """Ranks (of the default group) that lack their file."""
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, have_file)
    return [rank for rank, present in enumerate(flags) if not present]


def _load_hook(accelerator: Any):
    def load(models: list, input_dir: str) -> None:
        accelerator._qaccel_sharded_payloads = []
        for optimizer in _onebit_optimizers(accelerator):
            rank, world = accelerator.process_index, optimizer.world_size()
            path = onebit_rank_path(input_dir, rank)
            if optimizer.is_sharded:
                # Nothing else holds a sharded optimizer's state, so a missing file is an error, raised on
                # every rank (one all-gather of a flag) before Accelerate's own collectives start.
                missing = _ranks_missing(path.exists())
                if missing:
                    files = ", ".join(onebit_rank_path(input_dir, r).name for r in missing)
                    raise FileNotFoundError(
                        f"{input_dir}: missing {files}; the {type(optimizer).__name__} state of those ranks (HSDP shards) lives only there"
                    )
                payload = load_torch_file(path)
                if payload.get("rank") != rank:
                    raise RuntimeError(f"{path}: holds the state of rank {payload.get('rank')}, expected rank {rank}")
                optimizer.check_rank_state(payload)  # before Accelerate loads anything
                accelerator._qaccel_sharded_payloads.append((optimizer, payload))
                continue
            if not path.exists():
                logger.warning(
                    "rank %d: %s not found; this rank resumes without its error buffers (all ranks will reset "
                    "them and average weights and momentum)", rank, path.name,
                )  # fmt: skip
                continue
            payload = load_torch_file(path)  # weights_only: tensors and plain values, no code
            if payload.get("world_size") != world:
                logger.warning(
                    "rank %d: %s was saved with world size %s, now %d: error feedback is reset",
                    rank, path.name, payload.get("world_size"), world,
                )  # fmt: skip
                continue
            if payload.get("rank") != rank:
                raise RuntimeError(f"{path}: holds the state of rank {payload.get('rank')}, expected rank {rank}")
            optimizer.stage_rank_state(payload)

    return load


def before_clip_grad_norm(accelerator: Any) -> None:
    """Warn once when ``accelerator.clip_grad_norm_`` is used with a prepared 1-bit optimizer.

    Under DDP Accelerate clips with each rank's local norm; on steps whose gradients stay local the
    ranks then clip differently. The optimizer's own ``gradient_clipping`` uses a norm that is the
    same on every rank (see the README, "Clipping"). It also turns ``overlap_comm`` off from the next
    backward on: an overlapped 1-bit all-reduce reads the gradients in backward, before this clips them.
    """
    optimizers = _onebit_optimizers(accelerator)
    for optimizer in optimizers:
        # Clipping changes the gradients after backward, where an overlapped all-reduce already read them.
        optimizer.disable_comm_overlap("accelerator.clip_grad_norm_ changes gradients after backward (overlap_comm)")
    if getattr(accelerator, "_qaccel_warned_clip", False) or not optimizers:
        return
    accelerator._qaccel_warned_clip = True
    logger.warning(
        "accelerator.clip_grad_norm_ with a qaccel 1-bit optimizer clips each rank's local gradient with its own "
        "norm on steps without a full all-reduce; pass gradient_clipping=<max_norm> to ZeroOneAdam/OneBitAdam "
        "instead for a rank-consistent norm"
    )
