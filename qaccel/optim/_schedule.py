"""Phase machines of 0/1 Adam and 1-bit Adam, and the comm plan the DDP hook reads.

Each optimizer step has one :class:`StepKind`, decided before the step from the schedule state alone,
so the DDP communication hook (which runs during the backward of that step) and the optimizer always
agree on whether the gradients were all-reduced in full precision. This replaces DeepSpeed's
``engine.enable_backward_allreduce`` toggling (``docs/accelerate.md``, "The DDP comm hook").

The step rules are DeepSpeed's code semantics (``zoadam.py``, ``adam.py``), which differ from the
tutorial formulas (``docs/zero_one_adam.md``, "Schedules"): variance intervals double after ``var_update_scaler`` updates,
and in phase 2 a sync happens iff the *global* step is a multiple of the current interval.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

__all__ = [
    "StepKind",
    "COMPRESSED_KINDS",
    "Phase",
    "ZeroOneAdamSchedule",
    "OneBitAdamSchedule",
    "CommPlan",
    "count_step_kinds",
]


class StepKind(str, Enum):
    """What one optimizer step does and communicates (``docs/zero_one_adam.md``, "What travels when")."""

    INIT = "init"
    """First step: state is created, the gradient is discarded, nothing is communicated."""
    FULL = "full"
    """Gradients were all-reduced in full precision (0/1 Adam variance step, 1-bit Adam warm-up)."""
    ONEBIT_GRADIENT = "onebit_gradient"
    """0/1 Adam phase 1: the local gradient goes through the 1-bit all-reduce; variance untouched."""
    ONEBIT_MOMENTUM = "onebit_momentum"
    """1-bit Adam after the freeze: the local momentum goes through the 1-bit all-reduce."""
    LOCAL = "local"
    """0/1 Adam phase 2: local step, no communication."""
    SYNC = "sync"
    """0/1 Adam phase 2: local step, then the accumulated update goes through the 1-bit all-reduce."""


COMPRESSED_KINDS = frozenset({StepKind.ONEBIT_GRADIENT, StepKind.ONEBIT_MOMENTUM, StepKind.SYNC})
"""Step kinds that issue the 1-bit all-reduce: every rank must join it, and it may start in backward."""


class Phase(str, Enum):
    """Phase of a schedule between steps."""

    INIT = "init"
    """Before the first step."""
    VARIANCE = "variance"
    """0/1 Adam phase 1 (steps 2..F+1): variance updated on doubling intervals."""
    LOCAL_STEPS = "local_steps"
    """0/1 Adam phase 2: variance frozen, local steps between 1-bit syncs."""
    WARMUP = "warmup"
    """1-bit Adam: full Adam with all-reduced gradients."""
    COMPRESSED = "compressed"
    """1-bit Adam: variance frozen, compressed momentum every step."""


def _check_positive_int(owner: str, key: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{owner}.{key}={value!r}: must be an int >= {low}")


@dataclass
class ZeroOneAdamSchedule:
    """Step counter and interval state of 0/1 Adam; every rank holds an identical copy.

    Attributes:
        var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper: F, kappa, alpha, H.
        step: completed optimizer steps (the next step is ``step + 1``).
        phase: :class:`Phase` between steps.
        var_interval, var_counter: variance schedule (an update at t iff ``t % var_interval == 0``).
        local_step_interval, local_step_counter: sync schedule of phase 2.
        steps_since_sync: phase-2 steps since the last sync (0 at a synced point).
    """

    var_freeze_step: int
    var_update_scaler: int
    local_step_scaler: int
    local_step_clipper: int
    step: int = 0
    phase: Phase = Phase.INIT
    var_interval: int = 1
    var_counter: int = 0
    local_step_interval: int = 1
    local_step_counter: int = 0
    steps_since_sync: int = 0

    def __post_init__(self) -> None:
        _check_positive_int("ZeroOneAdamSchedule", "var_freeze_step", self.var_freeze_step, 0)
        for key in ("var_update_scaler", "local_step_scaler", "local_step_clipper"):
            _check_positive_int("ZeroOneAdamSchedule", key, getattr(self, key), 1)
        self.phase = Phase(self.phase)

    def next_kind(self) -> StepKind:
        """Kind of the next step, from the state alone."""
        t = self.step + 1
        if self.phase is Phase.INIT:
            return StepKind.INIT
        if self.phase is Phase.VARIANCE:
            return StepKind.FULL if t % self.var_interval == 0 else StepKind.ONEBIT_GRADIENT
        return StepKind.SYNC if t % self.local_step_interval == 0 else StepKind.LOCAL

    def advance(self, kind: StepKind) -> bool:
        """Close a step of ``kind``; return True when the variance froze at the end of it."""
        expected = self.next_kind()
        if kind is not expected:
            raise RuntimeError(f"ZeroOneAdamSchedule: step {self.step + 1} must be {expected.value}, got {kind.value}")
        self.step += 1
        t = self.step
        if self.phase is Phase.INIT:
            self.phase = Phase.VARIANCE
            return False
        if self.phase is Phase.VARIANCE:
            if t % self.var_interval == 0:
                self.var_counter += 1
                if self.var_counter == self.var_update_scaler:
                    self.var_counter = 0
                    self.var_interval *= 2
            # DeepSpeed tests the step counter after the step: steps 2..F+1 belong to phase 1.
            if t > self.var_freeze_step:
                self.phase = Phase.LOCAL_STEPS
                return True
            return False
        self.steps_since_sync = 0 if kind is StepKind.SYNC else self.steps_since_sync + 1
        self.local_step_counter += 1
        if self.local_step_counter == self.local_step_scaler:
            self.local_step_counter = 0
            self.local_step_interval = min(self.local_step_clipper, 2 * self.local_step_interval)
        return False

    @property
    def variance_updates(self) -> int:
        """Variance updates the completed steps made (FULL steps): ``kappa`` per finished interval, plus the counter.

        Intervals double from 1 after every ``kappa`` updates, so ``log2(var_interval)`` intervals are finished.
        The count stops at the freeze (phase 2 leaves both counters alone).
        """
        return self.var_update_scaler * (self.var_interval.bit_length() - 1) + self.var_counter

    def state_dict(self) -> dict[str, Any]:
        """Plain dict (ints and strings) for ``weights_only`` checkpoints."""
        data = asdict(self)
        data["phase"] = self.phase.value
        return data

    def load_state_dict(self, data: dict[str, Any]) -> None:
        """Restore the counters in place; the live hyperparameters (F, kappa, alpha, H) are kept."""
        for key in ("step", "var_interval", "var_counter", "local_step_interval", "local_step_counter", "steps_since_sync"):
            setattr(self, key, int(data[key]))
        self.phase = Phase(data["phase"])


@dataclass
class OneBitAdamSchedule:
    """Step counter and phase of 1-bit Adam.

    Attributes:
        freeze_step: the last warm-up step is ``max(freeze_step, 2)`` (DeepSpeed freezes after a step
            whose counter is ``>= freeze_step``, and never at the initialization step).
        step: completed optimizer steps.
        phase: :class:`Phase` between steps.
    """

    freeze_step: int
    step: int = 0
    phase: Phase = Phase.INIT

    def __post_init__(self) -> None:
        _check_positive_int("OneBitAdamSchedule", "freeze_step", self.freeze_step, 0)
        self.phase = Phase(self.phase)

    def next_kind(self) -> StepKind:
        if self.phase is Phase.INIT:
            return StepKind.INIT
        return StepKind.FULL if self.phase is Phase.WARMUP else StepKind.ONEBIT_MOMENTUM

    def advance(self, kind: StepKind) -> bool:
        """Close a step of ``kind``; return True when the variance froze at the end of it."""
        expected = self.next_kind()
        if kind is not expected:
            raise RuntimeError(f"OneBitAdamSchedule: step {self.step + 1} must be {expected.value}, got {kind.value}")
        self.step += 1
        if self.phase is Phase.INIT:
            self.phase = Phase.WARMUP
            return False
        if self.phase is Phase.WARMUP and self.step >= self.freeze_step:
            self.phase = Phase.COMPRESSED
            return True
        return False

    @property
    def variance_updates(self) -> int:
        """Variance updates the completed steps made: one per warm-up step ``2..step``, frozen after ``max(freeze_step, 2)``."""
        if self.phase is Phase.COMPRESSED:
            return max(self.freeze_step, 2) - 1
        return max(self.step - 1, 0)

    @property
    def steps_since_sync(self) -> int:
        """Always 0: 1-bit Adam keeps the replicas identical after every step."""
        return 0

    def state_dict(self) -> dict[str, Any]:
        return {"freeze_step": self.freeze_step, "step": self.step, "phase": self.phase.value}

    def load_state_dict(self, data: dict[str, Any]) -> None:
        self.step = int(data["step"])
        self.phase = Phase(data["phase"])


class CommPlan:
    """Read-only answer to "are the next step's gradients all-reduced in full precision?".

    Shared by an optimizer and the DDP communication hook; it reads the optimizer's schedule, so it
    cannot disagree with the step that consumes the gradients.
    """

    def __init__(self, schedule: ZeroOneAdamSchedule | OneBitAdamSchedule) -> None:
        self._schedule = schedule

    @property
    def next_kind(self) -> StepKind:
        return self._schedule.next_kind()

    @property
    def full_allreduce_next(self) -> bool:
        return self._schedule.next_kind() is StepKind.FULL

    def __repr__(self) -> str:
        return f"CommPlan(next_kind={self.next_kind.value}, full_allreduce_next={self.full_allreduce_next})"


def count_step_kinds(
    make_schedule: Callable[[], ZeroOneAdamSchedule | OneBitAdamSchedule], total_steps: int
) -> dict[StepKind, int]:
    """Run a fresh schedule for ``total_steps`` steps and count each :class:`StepKind`."""
    schedule = make_schedule()
    counts: Counter[StepKind] = Counter()
    for _ in range(total_steps):
        kind = schedule.next_kind()
        counts[kind] += 1
        schedule.advance(kind)
    return {kind: counts.get(kind, 0) for kind in StepKind}
