"""The randomized Hadamard rotation of the specification: steps 7-10 of :mod:`qaccel.quant.reference`.

Part of the reference; import :func:`hadamard_rotate` from :mod:`qaccel.quant.reference`.
"""

from __future__ import annotations

import math

import torch

from ._rng import rotation_signs
from ._types import rotation_blocks

__all__ = ["hadamard_rotate"]


def _butterflies(w: torch.Tensor) -> torch.Tensor:
    """Walsh-Hadamard butterflies (unnormalized) over the last dim of ``w`` (fp64, a power of two long)."""
    rows, length = w.shape
    h = 1
    while h < length:
        pairs = w.view(rows, length // (2 * h), 2, h)
        a, c = pairs[:, :, 0, :], pairs[:, :, 1, :]
        w = torch.stack((a + c, a - c), dim=2).view(rows, length)
        h *= 2
    return w


def hadamard_rotate(x: torch.Tensor, bucket_size: int, seed: int, inverse: bool = False) -> torch.Tensor:
    """Rotate (or, with ``inverse``, rotate back) a flat segment bucket by bucket; returns fp32.

    Steps 7-10 of the module docstring: randomized Walsh-Hadamard transform per power-of-two block,
    signs from ``seed``. ``hadamard_rotate(hadamard_rotate(x, B, s), B, s, inverse=True)`` equals
    ``x`` up to fp32 rounding.
    """
    xf = x.reshape(-1).to(torch.float32)
    numel = xf.numel()
    out = torch.empty(numel, dtype=torch.float32, device=x.device)
    if numel == 0:
        return out
    signs = rotation_signs(seed, numel, x.device)
    w_all = xf.double() if inverse else xf.double() * signs
    full = numel // bucket_size
    spans = []  # (start of the first bucket, buckets, block offset in the bucket, block length)
    if full:
        offset = 0
        for block in rotation_blocks(bucket_size):
            spans.append((0, full, offset, block))
            offset += block
    offset = full * bucket_size
    for block in rotation_blocks(numel - offset):
        spans.append((offset, 1, 0, block))
        offset += block
    for start, buckets, in_bucket, block in spans:
        rows = w_all[start : start + buckets * bucket_size].view(buckets, -1)[:, in_bucket : in_bucket + block]
        w = _butterflies(rows.contiguous()) * (1.0 / math.sqrt(block))
        target = out[start : start + buckets * bucket_size].view(buckets, -1)[:, in_bucket : in_bucket + block]
        if inverse:
            row_signs = signs[start : start + buckets * bucket_size].view(buckets, -1)[:, in_bucket : in_bucket + block]
            w = w * row_signs
        target.copy_(w.to(torch.float32))
    return out
