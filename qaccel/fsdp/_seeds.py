"""Seeds of every codec call: reproducible from the global seed, fresh per step and call site.

``docs/qsdp.md``, "Seeds": the seed of one encode is a hash of (global seed, optimizer step, FSDP
unit index, owner rank, direction, destination rank) and, for gradients only, the index of the
reduce-scatter call of that unit within the step.

- Weights: no per-call term, so the backward re-gather of a unit (``reshard_after_forward=True``)
  decodes bit-identical weights to the forward gather, and every micro-batch of one optimizer step
  computes with the same quantized weights (the weights do not change between them either).
- Gradients: the owner is the rank's index among all ranks of the model (``replica * S + shard
  rank`` under hierarchical QSDP, the shard rank on a 1-D mesh), so replicas of a shard round their
  different gradients with independent noise. FSDP2 reduce-scatters once per backward unless gradient sync is switched off for the
  micro-batch (Accelerate's ``sync_each_batch=True``, or plain FSDP2 without
  ``set_requires_gradient_sync(False)``). Each of those calls rounds a different gradient, and its
  rounding noise must be independent of the others', or the accumulated gradient's error would not
  shrink with the number of micro-batches. So the per-unit call counter is part of the seed.

The step advances in an optimizer step post-hook, which also resets the call counters; a step
skipped on overflow never runs the hook and keeps counting calls, so no noise repeats. The
counters are part of :meth:`SeedSchedule.state_dict`, so a checkpoint taken between micro-batches
resumes with the seeds an uninterrupted run would have drawn.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

from ..comm import mix_seed

__all__ = ["Direction", "SeedSchedule"]


class Direction(IntEnum):
    """Which codec call a seed is for; part of the hash so directions never share noise."""

    WEIGHT = 1
    GRAD = 2
    MASTER = 3
    REPLICA_GRAD = 4  # hierarchical QSDP: the reduce-scatter across replicas
    REPLICA_GATHER = 5  # ... and the all-gather of the reduced chunks across replicas


class SeedSchedule:
    """The optimizer-step counter, per-unit gradient call counters and the seed derivation.

    One schedule is shared by all units of one model.

    Args:
        seed: the global seed (``QSDPConfig.seed``).
    """

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)
        self.step = 0
        self._grad_calls: dict[int, int] = {}
        self._replica_calls: dict[int, int] = {}

    def advance(self) -> None:
        """Called after every optimizer step that ran: next step, gradient call counters back to 0."""
        self.step += 1
        self._grad_calls.clear()
        self._replica_calls.clear()

    def grad_calls(self, unit: int) -> int:
        """Reduce-scatter calls of ``unit`` so far in this step."""
        return self._grad_calls.get(unit, 0)

    def next_grad_call(self, unit: int) -> int:
        """The index of this reduce-scatter call of ``unit`` within the step (0, 1, ...)."""
        call = self._grad_calls.get(unit, 0)
        self._grad_calls[unit] = call + 1
        return call

    def next_replica_call(self, unit: int) -> int:
        """The index of this all-reduce of ``unit`` across replicas within the step (0, 1, ...)."""
        call = self._replica_calls.get(unit, 0)
        self._replica_calls[unit] = call + 1
        return call

    def replica_seed(self, unit: int, owner: int, direction: Direction, dest: int, call: int) -> int:
        """Seed with which ``owner`` (index among all ranks) quantizes a chunk of ``unit`` across replicas."""
        return mix_seed(self.seed, self.step, unit, owner, direction, dest, call)

    def weight_seed(self, unit: int, owner: int) -> int:
        """Seed with which ``owner`` quantizes its shard of ``unit`` for this step's all-gathers."""
        return mix_seed(self.seed, self.step, unit, owner, Direction.WEIGHT, 0)

    def grad_seed(self, unit: int, owner: int, dest: int, call: int) -> int:
        """Seed with which ``owner`` quantizes the chunk of ``unit`` it sends to ``dest`` in reduce-scatter ``call``."""
        return mix_seed(self.seed, self.step, unit, owner, Direction.GRAD, dest, call)

    def master_seed(self, unit: int, owner: int) -> int:
        """Seed of the ``master_weights="quantized"`` re-rounding after step ``self.step``."""
        return mix_seed(self.seed, self.step, unit, owner, Direction.MASTER, 0)

    def state_dict(self) -> dict[str, Any]:
        # String keys: the state also travels as JSON (Trainer checkpoints).
        return {
            "seed": self.seed,
            "step": self.step,
            "grad_calls": {str(unit): calls for unit, calls in self._grad_calls.items()},
            "replica_calls": {str(unit): calls for unit, calls in self._replica_calls.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(f"QSDP checkpoint: seed={state['seed']} but this run has QSDPConfig.seed={self.seed}")
        self.step = int(state["step"])
        self._grad_calls = {int(unit): int(calls) for unit, calls in state.get("grad_calls", {}).items()}
        self._replica_calls = {int(unit): int(calls) for unit, calls in state.get("replica_calls", {}).items()}
