"""Seeds of every codec call: reproducible from the global seed, fresh per step and call site.

``shared/design/qsdp.md`` section 2.5: the seed of one encode is a hash of (global seed, optimizer
step, FSDP unit index, owner rank, direction, destination rank). It has no per-call counter, so
the backward re-gather of a unit (``reshard_after_forward=True``) decodes bit-identical weights to
the forward gather. The step advances in an optimizer step post-hook; a step skipped on overflow
never runs the hook and reuses its seed, which is harmless.
"""

from __future__ import annotations

from enum import IntEnum

from ..comm import mix_seed

__all__ = ["Direction", "SeedSchedule"]


class Direction(IntEnum):
    """Which codec call a seed is for; part of the hash so directions never share noise."""

    WEIGHT = 1
    GRAD = 2
    MASTER = 3


class SeedSchedule:
    """The optimizer-step counter and the seed derivation shared by all units of one model.

    Args:
        seed: the global seed (``QSDPConfig.seed``).
    """

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)
        self.step = 0

    def advance(self) -> None:
        """Called after every optimizer step that ran."""
        self.step += 1

    def weight_seed(self, unit: int, owner: int) -> int:
        """Seed with which ``owner`` quantizes its shard of ``unit`` for this step's all-gathers."""
        return mix_seed(self.seed, self.step, unit, owner, Direction.WEIGHT, 0)

    def grad_seed(self, unit: int, owner: int, dest: int) -> int:
        """Seed with which ``owner`` quantizes the gradient chunk of ``unit`` it sends to ``dest``."""
        return mix_seed(self.seed, self.step, unit, owner, Direction.GRAD, dest)

    def master_seed(self, unit: int, owner: int) -> int:
        """Seed of the ``master_weights="quantized"`` re-rounding after step ``self.step``."""
        return mix_seed(self.seed, self.step, unit, owner, Direction.MASTER, 0)

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(f"QSDP checkpoint: seed={state['seed']} but this run has QSDPConfig.seed={self.seed}")
        self.step = int(state["step"])
