"""DiLoCo (Douillard et al., arXiv 2311.08105) on DDP: every rank is an island that syncs every H steps.

Inside the context the per-step gradient all-reduce is off (DDP's ``no_sync``, as Accelerate's
``LocalSGD`` does), so each rank's inner optimizer trains its own copy of the model. Every
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
parameters), as in the paper's data-parallel replicas. Islands of FSDP2 or HSDP shards are not
supported by this class: a model with an ``FSDPModule`` is refused.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import WireCodec, WireMeter, default_meter, ring_all_reduce_bytes
from ..fsdp import QuantizedReplicaAllReduce, SeedSchedule, UnitPlan, merge_segments

__all__ = ["DiLoCo", "KIND_OUTER_ALL_REDUCE", "KIND_OUTER_REDUCE_SCATTER", "KIND_OUTER_ALL_GATHER"]

KIND_OUTER_ALL_REDUCE = "diloco.outer_all_reduce"  # fp32
KIND_OUTER_REDUCE_SCATTER = "diloco.outer_reduce_scatter"  # outer_bits
KIND_OUTER_ALL_GATHER = "diloco.outer_all_gather"
QUANTIZE_MIN_NUMEL = 1024  # smaller or 1-D parameters travel raw, as QSDP's param_min_numel
_ACTIVE: set[int] = set()  # id() of the models inside a DiLoCo context


def _check_settings(sync_every: Any, outer_lr: Any, outer_momentum: Any, outer_bits: Any, outer_error_feedback: Any) -> None:
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"DiLoCo sync_every={sync_every!r}: must be an int >= 1 (inner optimizer steps between syncs)")
    if isinstance(outer_lr, bool) or not isinstance(outer_lr, (int, float)) or not math.isfinite(outer_lr) or outer_lr <= 0:
        raise ValueError(f"DiLoCo outer_lr={outer_lr!r}: must be a finite number > 0 (the paper uses 0.7)")
    if isinstance(outer_momentum, bool) or not isinstance(outer_momentum, (int, float)) or not 0 <= outer_momentum < 1:
        raise ValueError(f"DiLoCo outer_momentum={outer_momentum!r}: must be a number in [0, 1) (the paper uses 0.9)")
    if outer_bits is not None and (isinstance(outer_bits, bool) or not isinstance(outer_bits, int) or not 2 <= outer_bits <= 8):
        raise ValueError(f"DiLoCo outer_bits={outer_bits!r}: must be None (fp32) or an int in [2, 8]")
    if not isinstance(outer_error_feedback, bool):
        raise ValueError(f"DiLoCo outer_error_feedback={outer_error_feedback!r}: must be True or False")


def _check_model(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError(
            "DiLoCo: the model is sharded with FSDP2 (an FSDPModule); islands of FSDP2 or HSDP shards are not supported by "
            "qaccel.optim.DiLoCo: prepare the model with DDP (each rank an island)"
        )
    if dist.is_initialized() and dist.get_world_size() > 1 and not isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError(
            f"DiLoCo: the model is a {type(model).__name__}, not DistributedDataParallel, on {dist.get_world_size()} ranks: "
            "pass the model accelerator.prepare returned (DDP), whose per-step gradient sync DiLoCo turns off"
        )


class DiLoCo:
    """Context manager: DiLoCo's outer loop around a user's DDP training loop (``diloco.step()`` after each optimizer step).

    Args:
        accelerator: the run's ``Accelerator`` (its ``sync_gradients`` says which calls end an optimizer step).
        model: the model ``accelerator.prepare`` returned (DDP; a plain module on one process).
        sync_every: H, the optimizer steps between outer syncs.
        outer_lr: the outer SGD's learning rate (0.7 in the paper; 1.0 with momentum 0 is parameter averaging).
        outer_momentum: the outer SGD's Nesterov momentum (0.9 in the paper; 0: plain SGD).
        outer_bits: the pseudo-gradient's bits on the wire (2..8), or None for fp32.
        outer_error_feedback: with ``outer_bits``, add what the last sync's quantization dropped to the
            next sync's values (this rank's sent chunks and its summed chunk), as 1-bit Adam does.
        seed: the stochastic rounding's seed (with ``outer_bits``).
        meter: where the outer all-reduce's bytes are recorded (default: qaccel's process-wide meter).

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
        meter: WireMeter | None = None,
    ) -> None:
        _check_settings(sync_every, outer_lr, outer_momentum, outer_bits, outer_error_feedback)
        _check_model(model)
        self.accelerator = accelerator
        self.model = model
        self.sync_every = sync_every
        self.outer_bits = outer_bits
        self.outer_error_feedback = outer_error_feedback
        self.meter = default_meter if meter is None else meter
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.numels = [p.numel() for p in self.params]
        self.global_weights = torch.cat([p.detach().reshape(-1).float() for p in self.params])
        self.outer_optimizer = torch.optim.SGD([self.global_weights], lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)
        self.inner_steps = 0
        self.syncs = 0
        self.seeds = SeedSchedule(seed)
        self._no_sync: Any = None
        self._quantized = self._quantized_all_reduce() if outer_bits is not None and self.islands > 1 else None

    @property
    def islands(self) -> int:
        """How many islands average their pseudo-gradients (the ranks of the default group)."""
        return dist.get_world_size() if dist.is_initialized() else 1

    def _quantized_all_reduce(self) -> QuantizedReplicaAllReduce:
        bits = self.outer_bits
        segments = merge_segments((p.numel(), p.dim() >= 2 and p.numel() >= QUANTIZE_MIN_NUMEL) for p in self.params)
        plan = UnitPlan(index=0, name="diloco", segments=segments, enabled=True)
        codec = WireCodec(bits=bits, bucket_size=1024 if bits == 8 else 128)
        group = dist.group.WORLD
        kinds = (KIND_OUTER_REDUCE_SCATTER, KIND_OUTER_ALL_GATHER)
        return QuantizedReplicaAllReduce(plan, codec, self.seeds, self.meter, group, dist.get_rank(), kinds=kinds, error_feedback=self.outer_error_feedback)

    def __enter__(self) -> DiLoCo:
        if id(self.model) in _ACTIVE:
            raise RuntimeError("DiLoCo: this model is already inside a DiLoCo context; one context per model")
        _ACTIVE.add(id(self.model))
        if isinstance(self.model, nn.parallel.DistributedDataParallel):
            self._no_sync = self.model.no_sync()  # islands: no gradient all-reduce between syncs
            self._no_sync.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if exc_type is None and self.inner_steps % self.sync_every:
                self.sync()  # a begun period: every rank leaves with the same weights
        finally:
            if self._no_sync is not None:
                self._no_sync.__exit__(exc_type, exc, tb)
                self._no_sync = None
            _ACTIVE.discard(id(self.model))

    def step(self) -> None:
        """Count an optimizer step (calls inside gradient accumulation count once, at its boundary); sync every ``sync_every``."""
        if id(self.model) not in _ACTIVE:
            raise RuntimeError("DiLoCo.step() outside its context: use `with DiLoCo(...) as diloco:`")
        if not getattr(self.accelerator, "sync_gradients", True):
            return  # a micro-step of gradient accumulation: the optimizer did not step
        self.inner_steps += 1
        if self.inner_steps % self.sync_every == 0:
            self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """Average the pseudo-gradients over the islands, take the outer step, and restart every island from the result."""
        local = torch.cat([p.detach().reshape(-1).float() for p in self.params])
        delta = self.global_weights - local
        if self._quantized is not None:
            self._quantized(delta)
            self.seeds.advance()
        elif self.islands > 1:
            nbytes = ring_all_reduce_bytes(delta.numel() * delta.element_size(), self.islands)
            self.meter.record(KIND_OUTER_ALL_REDUCE, sent_bytes=nbytes, recv_bytes=nbytes)
            dist.all_reduce(delta, op=dist.ReduceOp.SUM)
        self.global_weights.grad = delta.div_(self.islands)
        self.outer_optimizer.step()
        self.global_weights.grad = None
        for param, values in zip(self.params, self.global_weights.split(self.numels), strict=True):
            param.copy_(values.view_as(param))
        self.syncs += 1

    def state_dict(self) -> dict[str, Any]:
        """The global weights, the outer optimizer, the rounding seeds and the step counters (equal on every rank)."""
        return {
            "sync_every": self.sync_every,
            "outer_bits": self.outer_bits,
            "inner_steps": self.inner_steps,
            "syncs": self.syncs,
            "global_weights": self.global_weights.detach().clone(),
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "seeds": self.seeds.state_dict(),
            # this rank's error-feedback buffers (outer_bits): what its quantized sends dropped so far
            "errors": [] if self._quantized is None else [t.clone() for pair in self._quantized.errors.values() for t in pair],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the period and the parameter count must match this run's."""
        for key in ("sync_every", "outer_bits"):
            if state[key] != getattr(self, key):
                raise ValueError(f"DiLoCo checkpoint: {key}={state[key]} but this run has {key}={getattr(self, key)}")
        weights = state["global_weights"]
        if weights.numel() != self.global_weights.numel():
            raise ValueError(f"DiLoCo checkpoint: {weights.numel()} global weights but the model has {self.global_weights.numel()} trainable values")
        with torch.no_grad():
            self.global_weights.copy_(weights)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.seeds.load_state_dict(state["seeds"])
        if state.get("errors"):  # the one flat fp32 buffer's (sent chunks, own summed chunk)
            try:
                self._quantized.load_errors(self.global_weights.numel(), torch.float32, *state["errors"])
            except ValueError as error:
                raise ValueError(f"DiLoCo checkpoint: {error}") from None
        self.inner_steps, self.syncs = int(state["inner_steps"]), int(state["syncs"])
