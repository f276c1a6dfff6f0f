"""Update maths of 0/1 Adam and 1-bit Adam as free functions over fp32 tensors.

Each function is one line group of DeepSpeed's ``zoadam.py`` / ``adam.py`` step (``docs/zero_one_adam.md``),
written with the same torch operations in the same order, so that fp32 results agree with DeepSpeed to
the last bit where the inputs do. No bias correction by default; eps outside the square root; decoupled
weight decay added to the update direction. ``variance_correction`` (``sqrt(1 - beta2^k)``, from the
optimizers' ``variance_bias_correction`` setting) divides ``sqrt(v)`` as torch's Adam does; left at None,
the operations are exactly DeepSpeed's.

The functions run once per unit (parameter or flat group) and write intermediate results in place, so a
step allocates at most one temporary of the unit's size at a time (two with weight decay), never a
model-sized one. They never read a tensor value on the host (no ``.item()``), so on CUDA a step is
queued without waiting for the device.
"""

from __future__ import annotations

import torch

__all__ = [
    "update_moments",
    "update_momentum",
    "denominator",
    "adam_direction",
    "descend",
    "local_update",
    "local_step",
    "sync_payload",
    "finish_sync",
]


def update_moments(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, beta1: float, beta2: float) -> None:
    """Adam moments from an all-reduced gradient: ``v = b2 v + (1-b2) g^2``; ``m = b1 m + (1-b1) g``."""
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)


def update_momentum(exp_avg: torch.Tensor, grad: torch.Tensor, beta1: float) -> None:
    """Momentum only (variance frozen or skipped): ``m = b1 m + (1-b1) g``."""
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)


def denominator(exp_avg_sq: torch.Tensor, eps: float, variance_correction: float | None = None) -> torch.Tensor:
    """``sqrt(v) + eps`` (DeepSpeed), or ``sqrt(v) / c + eps`` with ``c = variance_correction`` (a new tensor).

    ``c = sqrt(1 - beta2^k)`` for a variance that holds ``k`` updates is Adam's bias correction, in the
    form torch's ``Adam`` computes it; without it a variance frozen after few updates keeps every later
    step up to ``1 / c`` times Adam's (:mod:`qaccel.optim._variance_bias`).
    """
    result = exp_avg_sq.sqrt()
    if variance_correction is not None:
        result.div_(variance_correction)
    return result.add_(eps)


def adam_direction(
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    weights: torch.Tensor,
    eps: float,
    weight_decay: float,
    variance_correction: float | None = None,
) -> torch.Tensor:
    """``d = m / (sqrt(v) + eps) + wd * w`` (a new tensor, the only full-size allocation without decay).

    Each operation rounds exactly as DeepSpeed's ``exp_avg / (exp_avg_sq.sqrt() + eps) + wd * p``; the
    intermediate results are written into ``d`` instead of new tensors. ``wd * w`` still needs a temporary:
    ``d.add_(w, alpha=wd)`` would be fused into one multiply-add on some kernels and round differently.
    With ``variance_correction`` the denominator is :func:`denominator`'s corrected one.
    """
    direction = denominator(exp_avg_sq, eps, variance_correction)
    torch.div(exp_avg, direction, out=direction)
    if weight_decay > 0.0:
        direction += weights * weight_decay
    return direction


def descend(weights: torch.Tensor, direction: torch.Tensor, lr: float) -> None:
    """``w = w - lr * d``, computed as DeepSpeed does (``-lr * d`` first, then added); ``d`` is overwritten."""
    weights.add_(direction.mul_(-lr))


def local_update(
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    weights: torch.Tensor,
    lr: float,
    eps: float,
    weight_decay: float,
    variance_correction: float | None = None,
) -> torch.Tensor:
    """``-lr d``, the update of a 0/1 Adam phase-2 step (a new tensor; ``weights`` only read)."""
    return adam_direction(exp_avg, exp_avg_sq, weights, eps, weight_decay, variance_correction).mul_(-lr)


def local_step(
    weights: torch.Tensor,
    momentum_accumulator: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    lr: float,
    eps: float,
    weight_decay: float,
    variance_correction: float | None = None,
) -> None:
    """0/1 Adam phase-2 step: ``w -= lr d`` and ``u -= lr d`` with the same ``-lr d``."""
    step = local_update(exp_avg, exp_avg_sq, weights, lr, eps, weight_decay, variance_correction)
    weights.add_(step)
    momentum_accumulator.add_(step)


def sync_payload(
    momentum_accumulator: torch.Tensor, exp_avg_sq: torch.Tensor, eps: float, variance_correction: float | None = None
) -> torch.Tensor:
    """What a sync communicates, ``u * (sqrt(v) + eps)``, computed in place in ``u`` (returned).

    The denominator must be the local steps' own (the same ``variance_correction``), so that the payload
    is the plain sum of ``-lr m`` that :func:`finish_sync` turns back into a momentum.
    """
    return momentum_accumulator.mul_(denominator(exp_avg_sq, eps, variance_correction))


def finish_sync(
    weights: torch.Tensor,
    synced_weights: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    momentum_accumulator: torch.Tensor,
    averaged: torch.Tensor,
    lrs: float,
    eps: float,
    variance_correction: float | None = None,
) -> None:
    """Apply the averaged payload ``w_bar`` of a sync (divided by :func:`denominator`'s ``sqrt(v) + eps``).

    ``m = -w_bar / lrs`` (the lr-weighted mean momentum since the last sync); the weights restart from
    the last synced point, ``w = w_sync + w_bar / (sqrt(v) + eps)``, which becomes the new synced point;
    ``u = 0``. ``averaged`` may be ``momentum_accumulator`` itself (world size 1): it is read before ``u``
    is zeroed.

    DeepSpeed instead undoes the local steps by subtraction (``w - u``), which lands a few ulps away from
    the synced point on each rank, so its replicas agree only to rounding after a sync. Restarting from
    the stored ``w_sync`` (identical on all ranks) keeps them bit-identical; the difference to DeepSpeed
    is within float32 rounding of the weights.
    """
    if lrs > 0.0:
        # -(w_bar / lrs) == w_bar / (-lrs) bit for bit (IEEE division is sign-symmetric); adding +0.0 turns
        # the -0.0 of a zero quotient into +0.0, as DeepSpeed's ``m.zero_().add_(w_bar / lrs, alpha=-1)``
        # gives, without its temporary.
        torch.div(averaged, -lrs, out=exp_avg).add_(0.0)
    else:  # lr was 0 since the last sync: there is no momentum to rebuild (DeepSpeed divides by 0)
        exp_avg.zero_()
    correction = denominator(exp_avg_sq, eps, variance_correction)
    torch.div(averaged, correction, out=correction)
    weights.copy_(synced_weights).add_(correction)
    synced_weights.copy_(weights)
    momentum_accumulator.zero_()
