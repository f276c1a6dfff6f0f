"""How much larger than Adam's a step on the frozen variance is, and the check ``qaccel train`` makes.

DeepSpeed's 1-bit optimizers keep no bias correction. After ``k`` updates from zero the variance is
``v = (1 - beta2) sum_i beta2^(k-i) g_i^2``, which for gradients of a steady scale is ``(1 - beta2^k)``
times Adam's corrected ``v_hat``. Frozen after ``k`` updates it stays that small for the rest of the run,
so every later step ``m / (sqrt(v) + eps)`` is up to ``1 / sqrt(1 - beta2^k)`` times Adam's (eps aside,
once the momentum's own bias has faded): 7.9x at ``k = 16`` and 15.8x at ``k = 4`` with beta2 = 0.999.
A fresh GPT-2 at lr 3e-4 with ``var_freeze_step`` 4 loses all it learnt within 16 steps that way
(``tests/unit/test_onebit_variance_bias.py``; on 2 ranks with real text it reaches NaN). The factor is
about the variance alone: it holds on every post-freeze step whatever the learning rate schedule, which
scales Adam's step and this one alike.

``variance_bias_correction`` removes it; without that option, settings whose factor exceeds
:data:`MAX_FROZEN_STEP_FACTOR` are refused by ``qaccel train`` (:func:`frozen_variance_problem`) and
logged by the optimizers (:func:`log_frozen_variance_factor`).
"""

from __future__ import annotations

import logging
import math

import torch.distributed as dist

from .config import OneBitAdamConfig, OneBitConfigBase, ZeroOneAdamConfig

__all__ = [
    "MAX_FROZEN_STEP_FACTOR",
    "variance_updates_at_freeze",
    "frozen_step_factor",
    "frozen_variance_factor",
    "smallest_safe_freeze_step",
    "frozen_variance_problem",
    "log_frozen_variance_factor",
]

logger = logging.getLogger(__name__)

MAX_FROZEN_STEP_FACTOR = 4.0
"""The largest factor over Adam's step that settings may imply before ``qaccel train`` refuses them."""


def _zero_one_adam_updates(var_freeze_step: int, var_update_scaler: int) -> int:
    """FULL steps among ``t = 2..max(F+1, 2)`` under :class:`ZeroOneAdamSchedule`'s doubling intervals.

    One pass per interval (``log2`` of the run, not its length): an interval ``I`` takes the next
    ``kappa`` multiples of ``I``; the next interval starts after the last of them.
    """
    last = max(var_freeze_step + 1, 2)  # the last phase-1 step: DeepSpeed freezes after step t > F
    count, t, interval = 0, 2, 1
    while True:
        first = -(-t // interval) * interval  # the first multiple of the interval at or after t
        if first > last:
            return count
        taken = min(var_update_scaler, (last - first) // interval + 1)
        count += taken
        if taken < var_update_scaler:
            return count
        t, interval = first + (var_update_scaler - 1) * interval + 1, 2 * interval


def _freeze_key(config: OneBitConfigBase) -> str:
    return "var_freeze_step" if isinstance(config, ZeroOneAdamConfig) else "freeze_step"


def _updates_at_freeze(config: OneBitConfigBase, freeze_step: int) -> int:
    if isinstance(config, ZeroOneAdamConfig):
        return _zero_one_adam_updates(freeze_step, config.var_update_scaler)
    if isinstance(config, OneBitAdamConfig):
        return max(freeze_step, 2) - 1
    raise TypeError(f"expected a ZeroOneAdamConfig or OneBitAdamConfig, got {type(config).__name__}")


def variance_updates_at_freeze(config: OneBitConfigBase) -> int:
    """``k``: the variance updates the variance holds when it freezes (what ``1 - beta2^k`` corrects).

    0/1 Adam: the variance steps among steps ``2..F+1`` (the interval doubles after ``var_update_scaler``
    updates, so ``k`` grows with ``log F``: 153 at F = 12,500, kappa 16). 1-bit Adam: every step
    ``2..max(freeze_step, 2)``, so ``max(freeze_step, 2) - 1``.

    Raises:
        TypeError: ``config`` is neither a :class:`ZeroOneAdamConfig` nor a :class:`OneBitAdamConfig`.
    """
    return _updates_at_freeze(config, getattr(config, _freeze_key(config)))


def frozen_step_factor(beta2: float, variance_updates: int) -> float:
    """``1 / sqrt(1 - beta2^k)``: how much larger than Adam's a step on an uncorrected variance of ``k`` updates is.

    Raises:
        ValueError: ``variance_updates < 1`` (an empty variance has no finite factor).
    """
    if variance_updates < 1:
        raise ValueError(f"variance_updates={variance_updates}: must be >= 1")
    return 1.0 / math.sqrt(1.0 - beta2**variance_updates)


def frozen_variance_factor(config: OneBitConfigBase) -> float:
    """The factor of every post-freeze step of ``config``'s run without bias correction (:func:`frozen_step_factor`)."""
    return frozen_step_factor(config.betas[1], variance_updates_at_freeze(config))


def smallest_safe_freeze_step(config: OneBitConfigBase, limit: float = MAX_FROZEN_STEP_FACTOR) -> int:
    """The smallest ``var_freeze_step`` / ``freeze_step`` whose factor is at most ``limit`` (other settings kept).

    The updates at the freeze never decrease with a later freeze step, so a binary search finds it.

    Raises:
        ValueError: ``limit <= 1`` (the factor only approaches 1).
    """
    if not limit > 1.0:
        raise ValueError(f"limit={limit!r}: must be > 1 (the factor 1/sqrt(1 - beta2^k) only approaches 1)")

    def too_large(freeze_step: int) -> bool:
        return frozen_step_factor(config.betas[1], _updates_at_freeze(config, freeze_step)) > limit

    low, high = 0, 1
    while too_large(high):
        low, high = high, 2 * high
    while low < high:
        middle = (low + high) // 2
        if too_large(middle):
            low = middle + 1
        else:
            high = middle
    return high


def _first_frozen_step(config: OneBitConfigBase) -> int:
    """The first optimizer step that runs on the frozen variance."""
    if isinstance(config, ZeroOneAdamConfig):
        return max(config.var_freeze_step + 1, 2) + 1
    return max(config.freeze_step, 2) + 1


def frozen_variance_problem(config: OneBitConfigBase, *, max_steps: int | None = None) -> str | None:
    """Why ``config`` would make post-freeze steps more than :data:`MAX_FROZEN_STEP_FACTOR` times Adam's, or None.

    None as well with ``variance_bias_correction`` on, or when a run of ``max_steps`` optimizer steps ends
    before the variance freezes. The message names the factor, its cause and the fixes.
    """
    if config.variance_bias_correction or (max_steps is not None and max_steps < _first_frozen_step(config)):
        return None
    factor = frozen_variance_factor(config)
    if factor <= MAX_FROZEN_STEP_FACTOR:
        return None
    key, updates, beta2 = _freeze_key(config), variance_updates_at_freeze(config), config.betas[1]
    return (
        f"{type(config).__name__}.{key}={getattr(config, key)} with betas[1]={beta2}: the variance freezes after {updates} "
        f"update(s) and carries no bias correction (DeepSpeed's rule), so every later step is up to "
        f"1/sqrt(1 - {beta2}^{updates}) = {factor:.1f}x Adam's (more than {MAX_FROZEN_STEP_FACTOR:g}x; such runs can "
        f"diverge to NaN within a few steps). Fix: a later freeze ({key} >= {smallest_safe_freeze_step(config)} keeps it "
        f"within {MAX_FROZEN_STEP_FACTOR:g}x), or variance_bias_correction=true (flag --zoadam_variance_bias_correction "
        "true: Adam's correction of the variance)"
    )


def log_frozen_variance_factor(config: OneBitConfigBase) -> None:
    """Log :func:`frozen_variance_problem` once per optimizer, on rank 0 (a library user has no launcher check)."""
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    problem = frozen_variance_problem(config)
    if problem is not None:
        logger.warning("%s", problem)
