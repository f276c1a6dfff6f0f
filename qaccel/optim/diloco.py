"""DiLoCo (Douillard et al., arXiv 2311.08105): islands (DDP ranks, or HSDP shard groups) that sync every H steps.

On DDP every rank is an island. Inside the context the per-step gradient all-reduce is off (DDP's
``no_sync``, as Accelerate's ``LocalSGD`` does), so each rank's inner optimizer trains its own copy
of the model. Every
``sync_every`` optimizer steps each island's pseudo-gradient, the global weights minus its own, is
averaged over the islands (one all-reduce), and an outer Nesterov SGD step (``torch.optim.SGD``)
moves the global weights, which every island then starts from. The inner optimizer's state stays
local.

The pseudo-gradient travels in fp32 (``dist.all_reduce``; every rank receives the same sum), or in
``outer_bits`` (2..8) through the quantized all-reduce hierarchical QSDP uses across replicas
(:class:`qaccel.fsdp.QuantizedReplicaAllReduce`: a k-bit reduce-scatter, then a k-bit all-gather that
every rank, the owner too, decodes), stochastically rounded, with error feedback unless turned off.
Either way the islands restart from bit-identical global weights.

The global weights and the outer momentum live on every rank in fp32 (two copies of the trainable
values it holds), as in the paper's data-parallel replicas.

On an HSDP model (FSDP2 units on the intra-node mesh: hierarchical QSDP, as ``qaccel.Accelerator``
prepares one under ``ParallelismConfig(dp_replicate_size=R, dp_shard_size=S)`` with a ``QSDPPlugin``)
each shard group of S ranks is an island: the replica all-reduce of every step is paused, every rank
keeps the global weights of its own shards, and their pseudo-gradients are averaged over the replica
group (the R ranks holding the same shard). Weights never cross the islands, only pseudo-gradients
(:mod:`qaccel.optim._diloco_islands`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import WireMeter, default_meter
from ..fsdp import INTER_ISLAND_PREFIX, SeedSchedule
from ._diloco_fragments import OuterFragment, fragment_offset, split_fragments
from ._diloco_islands import find_islands
from .diloco_config import DiLoCoConfig

__all__ = ["DiLoCo", "KIND_OUTER_ALL_REDUCE", "KIND_OUTER_REDUCE_SCATTER", "KIND_OUTER_ALL_GATHER"]

KIND_OUTER_ALL_REDUCE = f"{INTER_ISLAND_PREFIX}outer_all_reduce"  # fp32
KIND_OUTER_REDUCE_SCATTER = f"{INTER_ISLAND_PREFIX}outer_reduce_scatter"  # outer_bits
KIND_OUTER_ALL_GATHER = f"{INTER_ISLAND_PREFIX}outer_all_gather"
_ACTIVE: set[int] = set()  # id() of the models inside a DiLoCo context


class DiLoCo:
    """Context manager: DiLoCo's outer loop around a user's training loop (``diloco.step()`` after each optimizer step).

    Args:
        accelerator: the run's ``Accelerator`` (its ``sync_gradients`` says which calls end an optimizer step).
        model: the model ``accelerator.prepare`` returned: DDP (each rank an island), an HSDP model sharded
            on the intra-node mesh (each shard group an island), or a plain module on one process.
        sync_every: H, the optimizer steps between outer syncs.
        outer_lr: the outer SGD's learning rate (0.7 in the paper; 1.0 with momentum 0 is parameter averaging).
        outer_momentum: the outer SGD's Nesterov momentum (0.9 in the paper; 0: plain SGD).
        outer_bits: the pseudo-gradient's bits on the wire (2..8), or None for fp32.
        outer_error_feedback: with ``outer_bits``, add what the last sync's quantization dropped to the
            next sync's values (this rank's sent chunks and its summed chunk), as 1-bit Adam does.
        seed: the stochastic rounding's seed (with ``outer_bits``).
        fragments: F, parts of the model that sync in turn, staggered by ``sync_every / F`` steps
            (Streaming DiLoCo; ``qaccel.optim.DiLoCoConfig``); 1: the whole model every ``sync_every`` steps.
        meter: where the outer all-reduce's bytes are recorded (default: qaccel's process-wide meter).
        replica_group: on an HSDP model, the ranks holding this rank's shard in the other islands
            (default: the group hierarchical QSDP's hooks sum over); only for a model sharded by hand.

    On leaving the context without an exception, a period that has begun is synced, so every rank
    ends with the same weights. ``state_dict`` holds the global weights, the outer momentum and the
    counters; islands differ between syncs, so a resume needs each rank's model and inner optimizer
    state too (``docs/diloco.md``).

    Example::

        with DiLoCo(accelerator, model, sync_every=100, outer_lr=0.7, outer_momentum=0.9, outer_bits=4) as diloco:
            for batch in loader:
                accelerator.backward(model(**batch).loss)
                optimizer.step(); optimizer.zero_grad()
                diloco.step()
    """

    def __init__(
        self,
        accelerator: Any,
        model: nn.Module,
        *,
        sync_every: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        outer_bits: int | None = None,
        outer_error_feedback: bool = True,
        seed: int = 0,
        fragments: int = 1,
        meter: WireMeter | None = None,
        replica_group: dist.ProcessGroup | None = None,
    ) -> None:
        config = DiLoCoConfig(
            sync_every=sync_every, outer_lr=outer_lr, outer_momentum=outer_momentum, outer_bits=outer_bits,
            outer_error_feedback=outer_error_feedback, seed=seed, fragments=fragments,
        )  # fmt: skip
        self.layout = find_islands(model, replica_group)
        self.accelerator = accelerator
        self.model = model
        self.config = config
        self.sync_every = config.sync_every
        self.outer_bits = config.outer_bits
        self.outer_error_feedback = config.outer_error_feedback
        self.meter = default_meter if meter is None else meter
        self.seeds = SeedSchedule(config.seed)
        kinds = (KIND_OUTER_ALL_REDUCE, KIND_OUTER_REDUCE_SCATTER, KIND_OUTER_ALL_GATHER)
        split = split_fragments([p.numel() for p in self.layout.params], config.fragments)
        self.fragments = [OuterFragment(i, params, self.layout, config, self.seeds, self.meter, kinds) for i, params in enumerate(split)]
        self.inner_steps = 0
        self.syncs = 0
        self._apart: Any = None

    @property
    def islands(self) -> int:
        """How many islands average their pseudo-gradients (DDP: the ranks; HSDP: the replicas)."""
        return self.layout.count

    @property
    def global_weights(self) -> torch.Tensor:
        """The global weights this rank holds (its shards under HSDP), flat fp32, in parameter order."""
        return torch.cat([fragment.global_weights for fragment in self.fragments])

    @property
    def pending(self) -> bool:
        """Whether some fragment has trained since its last sync (the islands then differ)."""
        return any(fragment.synced_at != self.inner_steps for fragment in self.fragments)

    def __enter__(self) -> DiLoCo:
        if id(self.model) in _ACTIVE:
            raise RuntimeError("DiLoCo: this model is already inside a DiLoCo context; one context per model")
        _ACTIVE.add(id(self.model))
        self._apart = self.layout.apart()  # islands: no gradient sync between them until the outer step
        self._apart.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if exc_type is None:
                self.sync_pending()  # a begun period: every rank leaves with the same weights
        finally:
            if self._apart is not None:
                self._apart.__exit__(exc_type, exc, tb)
                self._apart = None
            _ACTIVE.discard(id(self.model))

    def step(self) -> None:
        """Count an optimizer step (calls inside gradient accumulation count once, at its boundary); sync what is due."""
        if id(self.model) not in _ACTIVE:
            raise RuntimeError("DiLoCo.step() outside its context: use `with DiLoCo(...) as diloco:`")
        if not getattr(self.accelerator, "sync_gradients", True):
            return  # a micro-step of gradient accumulation: the optimizer did not step
        self.inner_steps += 1
        count = len(self.fragments)
        self._sync([f for f in self.fragments if self.inner_steps % self.sync_every == fragment_offset(f.index, count, self.sync_every)])

    def sync(self) -> None:
        """Average every fragment's pseudo-gradient over the islands, take the outer steps, and restart every island from the result."""
        self._sync(self.fragments)

    def sync_pending(self) -> None:
        """Sync the fragments that trained since their last sync (none: nothing happens), so the islands hold one model."""
        self._sync([fragment for fragment in self.fragments if fragment.synced_at != self.inner_steps])

    def _sync(self, fragments: list[OuterFragment]) -> None:
        for fragment in fragments:
            fragment.sync(self.inner_steps)
        self.syncs += bool(fragments)  # one sync event, however many fragments it moved

    def state_dict(self) -> dict[str, Any]:
        """Every fragment's global weights (of this rank's shards under HSDP), outer optimizer and error feedback; the seeds and counters."""
        return {
            "sync_every": self.sync_every,
            "outer_bits": self.outer_bits,
            "fragments": [fragment.state_dict() for fragment in self.fragments],
            "inner_steps": self.inner_steps,
            "syncs": self.syncs,
            "seeds": self.seeds.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the period, bits, fragment count and sizes must match this run's."""
        for key in ("sync_every", "outer_bits"):
            if state[key] != getattr(self, key):
                raise ValueError(f"DiLoCo checkpoint: {key}={state[key]} but this run has {key}={getattr(self, key)}")
        if len(state["fragments"]) != len(self.fragments):
            raise ValueError(f"DiLoCo checkpoint: fragments={len(state['fragments'])} but this run has fragments={len(self.fragments)}")
        try:
            for fragment, saved in zip(self.fragments, state["fragments"], strict=True):
                fragment.load_state_dict(saved)
        except ValueError as error:
            message = str(error)
            raise ValueError(message if message.startswith("DiLoCo checkpoint") else f"DiLoCo checkpoint: {message}") from None
        self.seeds.load_state_dict(state["seeds"])
        self.inner_steps, self.syncs = int(state["inner_steps"]), int(state["syncs"])
