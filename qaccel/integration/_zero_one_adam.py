"""0/1 Adam and 1-bit Adam under Accelerate (DDP, or HSDP shards): comm hook, process groups, per-rank checkpoint files.

One :class:`OneBitWiring` per ``qaccel.Accelerator`` (``accelerator.onebit_wiring``, created with it) owns
all of it: the prepared DDP models, the checkpoint hooks, the optimizers left out of Accelerate's
checkpoint, the staged rank files and the clipping warning. Its ``after_prepare`` runs at the end of
every ``qaccel.Accelerator.prepare``. Once the prepared optimizer
wraps a qaccel 1-bit optimizer and the DDP model holding its parameters is prepared (same or a later
``prepare`` call), it:

1. installs the comm hook on the DDP model (``docs/accelerate.md``, "The DDP comm hook": Accelerate's
   ``DDPCommunicationHookType`` is a closed enum, so the hook is registered by hand; keep
   ``DistributedDataParallelKwargs.comm_hook`` at NO, DDP accepts one hook), with the fp16 overflow
   agreement when Accelerate uses a ``GradScaler``;
2. attaches the optimizer to the DDP process group and the accelerator's wire meter (a
   :class:`qaccel.optim.OneBitPlacement`, handed over by the hook registration), and until then refuses
   its steps in a multi-process run;
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
(:meth:`OneBitWiring.state_saved_per_rank`), every rank writes its complete state to its rank file, and
:meth:`OneBitWiring.after_load_state` restores it once Accelerate has loaded the model (whose file holds one replica's
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

__all__ = ["OneBitWiring"]

logger = logging.getLogger(__name__)

_UNSUPPORTED = {
    DistributedType.DEEPSPEED: "DeepSpeed brings its own engine (use DeepSpeed's ZeroOneAdam there)",
    DistributedType.MEGATRON_LM: "Megatron-LM brings its own engine",
}


class OneBitWiring:
    """What ``qaccel.Accelerator`` does for a prepared ZeroOneAdam / OneBitAdam; see the module docstring.

    Args:
        accelerator: the ``qaccel.Accelerator`` that owns this object (read, never changed, except for
            the save/load-state pre-hooks registered through its public methods).
    """

    def __init__(self, accelerator: Any) -> None:
        self._accelerator = accelerator
        # Accelerate's ``_models`` holds the unwrapped module, not the DDP wrapper it returns: remember the
        # wrappers of every prepare call, since the optimizer may be prepared in another call.
        self._ddp_models: list[DistributedDataParallel] = []
        self._left_out: list[AcceleratedOptimizer] = []  # during save_state / load_state (state_saved_per_rank)
        self._sharded_payloads: list[tuple[OneBitOptimizerBase, dict]] = []  # staged by the load pre-hook
        self._state_hooks_registered = False
        self._guarded: list[OneBitOptimizerBase] = []  # optimizers whose steps wait for their DDP hook
        self._warned_clip = False

    def optimizers(self) -> list[OneBitOptimizerBase]:
        """The prepared qaccel 1-bit optimizers (also while ``save_state`` / ``load_state`` leave one out)."""
        # A model and its optimizer may come from different prepare calls, so look at all of them, not only
        # this call's objects.
        prepared = prepared_optimizers(self._accelerator) + self._left_out
        return [opt.optimizer for opt in prepared if isinstance(opt, AcceleratedOptimizer) and isinstance(opt.optimizer, OneBitOptimizerBase)]

    def _ddp_model_for(self, optimizer: OneBitOptimizerBase) -> DistributedDataParallel | None:
        wanted = {id(p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
        for model in self._ddp_models:
            if wanted <= {id(p) for p in model.parameters()}:
                return model
        return None

    # ----------------------------------------------------------------------------------- prepare
    def before_prepare(self, args: tuple) -> None:
        """Refuse a 1-bit optimizer on FSDP unless it can run on HSDP shards; nothing is sharded yet."""
        accelerator = self._accelerator
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

    def after_prepare(self, objects: list) -> None:
        """Wire a prepared ZeroOneAdam / OneBitAdam to the prepared DDP (or HSDP) model and to checkpointing."""
        accelerator = self._accelerator
        self._ddp_models += [obj for obj in objects if isinstance(obj, DistributedDataParallel)]
        optimizers = self.optimizers()
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
        fsdp_models = [obj for obj in objects if isinstance(obj, FSDPModule)]
        if accelerator.distributed_type == DistributedType.FSDP:
            if fsdp_models and not optimizer.comm_hook_installed:
                replica_group = accelerator.torch_device_mesh[REPLICATE_DIM].get_group()
                register_hsdp_comm_hook(fsdp_models[0], optimizer, replica_group=replica_group, wire_meter=accelerator.wire_meter)
        elif accelerator.num_processes > 1:
            self._guard_steps(optimizer)
            model = self._ddp_model_for(optimizer)
            if model is not None and not optimizer.comm_hook_installed:
                register_ddp_comm_hook(
                    model, optimizer, wire_meter=accelerator.wire_meter, agree_on_overflow=accelerator.scaler is not None
                )
        if not self._state_hooks_registered:
            accelerator.register_save_state_pre_hook(self._save_pre_hook)
            accelerator.register_load_state_pre_hook(self._load_pre_hook)
            self._state_hooks_registered = True
            if accelerator.is_main_process:
                logger.info("%s config: %s", type(optimizer).__name__, optimizer.config.to_dict())

    def _guard_steps(self, optimizer: OneBitOptimizerBase) -> None:
        """Refuse ``optimizer.step()`` until a DDP hook attached the optimizer (torch's step pre-hook)."""
        if any(guarded is optimizer for guarded in self._guarded):
            return
        self._guarded.append(optimizer)

        def refuse_unwired(opt: OneBitOptimizerBase, args: Any, kwargs: Any) -> None:
            if not opt.comm_hook_installed:
                raise RuntimeError(
                    f"{type(opt).__name__}: no DDP model holding these parameters was prepared, so nothing decides "
                    "when gradients are all-reduced; pass the model to accelerator.prepare (or call "
                    "qaccel.optim.register_ddp_comm_hook)"
                )

        optimizer.register_step_pre_hook(refuse_unwired)

    # ------------------------------------------------------------------------------ checkpoints
    def save_rank_state(self, output_dir: str) -> None:
        """Every rank writes its 1-bit optimizer's private state to ``qaccel_zoadam_rank{r}.pt`` (atomically)."""
        for optimizer in self.optimizers():
            atomic_torch_save(optimizer.rank_state_dict(), onebit_rank_path(output_dir, self._accelerator.process_index))

    def stage_rank_state(self, input_dir: str) -> None:
        """Read this rank's file, so the next optimizer load restores the private state too.

        A DDP optimizer stages it for its next ``load_state_dict`` (a missing or mismatched file warns:
        the ranks then reset together). A sharded one is checked now and restored by
        :meth:`after_load_state`, once Accelerate has loaded the model.
        """
        self._sharded_payloads = []
        rank = self._accelerator.process_index
        for optimizer in self.optimizers():
            path = onebit_rank_path(input_dir, rank)
            if optimizer.is_sharded:
                self._sharded_payloads.append((optimizer, self._sharded_payload(optimizer, input_dir)))
                continue
            if not path.exists():
                logger.warning(
                    "rank %d: %s not found; this rank resumes without its error buffers (all ranks will reset "
                    "them and average weights and momentum)", rank, path.name,
                )  # fmt: skip
                continue
            payload = load_torch_file(path)  # weights_only: tensors and plain values, no code
            world = optimizer.world_size()
            if payload.get("world_size") != world:
                logger.warning(
                    "rank %d: %s was saved with world size %s, now %d: error feedback is reset",
                    rank, path.name, payload.get("world_size"), world,
                )  # fmt: skip
                continue
            if payload.get("rank") != rank:
                raise RuntimeError(f"{path}: holds the state of rank {payload.get('rank')}, expected rank {rank}")
            optimizer.stage_rank_state(payload)

    def _sharded_payload(self, optimizer: OneBitOptimizerBase, input_dir: str) -> dict:
        """This rank's file of a sharded optimizer, checked before Accelerate loads anything."""
        rank = self._accelerator.process_index
        path = onebit_rank_path(input_dir, rank)
        # Nothing else holds a sharded optimizer's state, so a missing file is an error, raised on every
        # rank (one all-gather of a flag) before Accelerate's own collectives start.
        flags = [None] * dist.get_world_size()
        dist.all_gather_object(flags, path.exists())
        missing = [r for r, present in enumerate(flags) if not present]
        if missing:
            files = ", ".join(onebit_rank_path(input_dir, r).name for r in missing)
            raise FileNotFoundError(
                f"{input_dir}: missing {files}; the {type(optimizer).__name__} state of those ranks (HSDP shards) lives only there"
            )
        payload = load_torch_file(path)
        if payload.get("rank") != rank:
            raise RuntimeError(f"{path}: holds the state of rank {payload.get('rank')}, expected rank {rank}")
        optimizer.check_rank_state(payload)
        return payload

    def _save_pre_hook(self, models: list, weights: list, output_dir: str) -> None:
        # Accelerate resolves output_dir (automatic checkpoint naming) before it calls its pre-hooks.
        self.save_rank_state(output_dir)

    def _load_pre_hook(self, models: list, input_dir: str) -> None:
        self.stage_rank_state(input_dir)

    @contextlib.contextmanager
    def state_saved_per_rank(self) -> Iterator[None]:
        """Around Accelerate's ``save_state`` / ``load_state``: a sharded 1-bit optimizer is left to the rank files."""
        left_out = [
            opt
            for opt in prepared_optimizers(self._accelerator)
            if isinstance(opt, AcceleratedOptimizer) and isinstance(opt.optimizer, OneBitOptimizerBase) and opt.optimizer.is_sharded
        ]
        self._left_out = left_out  # the save/load pre-hooks still write and read them
        try:
            with optimizers_left_out(self._accelerator, left_out):
                yield
        finally:
            self._left_out = []

    def after_load_state(self) -> None:
        """After Accelerate's ``load_state`` (the model is loaded): restore each sharded 1-bit optimizer from its rank file."""
        pending, self._sharded_payloads = self._sharded_payloads, []
        for optimizer, payload in pending:
            optimizer.load_rank_state(payload)

    # --------------------------------------------------------------------------------- clipping
    def before_clip_grad_norm(self) -> None:
        """Warn once when ``accelerator.clip_grad_norm_`` is used with a prepared 1-bit optimizer.

        Under DDP Accelerate clips with each rank's local norm; on steps whose gradients stay local the
        ranks then clip differently. The optimizer's own ``gradient_clipping`` uses a norm that is the
        same on every rank (see the README, "Clipping"). It also turns ``overlap_comm`` off from the next
        backward on: an overlapped 1-bit all-reduce reads the gradients in backward, before this clips them.
        """
        optimizers = self.optimizers()
        for optimizer in optimizers:
            if optimizer.comm_overlap is not None:
                # Clipping changes the gradients after backward, where an overlapped all-reduce already read them.
                optimizer.comm_overlap.disable("accelerator.clip_grad_norm_ changes gradients after backward (overlap_comm)")
        if self._warned_clip or not optimizers:
            return
        self._warned_clip = True
        logger.warning(
            "accelerator.clip_grad_norm_ with a qaccel 1-bit optimizer clips each rank's local gradient with its own "
            "norm on steps without a full all-reduce; pass gradient_clipping=<max_norm> to ZeroOneAdam/OneBitAdam "
            "instead for a rank-consistent norm"
        )
