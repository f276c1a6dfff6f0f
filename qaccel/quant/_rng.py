"""Counter-based random numbers for stochastic rounding.

Every backend (pure torch, C++, CUDA) derives the rounding offset ``u`` of element ``i`` from
``(seed, i)`` alone, so codes do not depend on the backend, thread count or device. The mixer is
Chris Wellons' ``lowbias32`` (https://nullprogram.com/blog/2018/07/31/), a bijective 32-bit hash
with low bias; ``u`` is its top 24 bits scaled by 2**-24, which an fp32 holds exactly.

Specification (all arithmetic on unsigned 32-bit integers, wrapping)::

    lowbias32(x): x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16
    key(seed, i)  = lowbias32(lo32(seed) ^ lowbias32(hi32(seed) + hi32(i)))
    hash(seed, i) = lowbias32(lo32(i) ^ key(seed, i))
    u(seed, i)    = (hash(seed, i) >> 8) * 2**-24                               # in [0, 1)
    sign(seed, i) = -1 if hash(seed, i) & 1 else +1     # Hadamard rotation signs (bit 0, unused by u)

``seed`` is an unsigned 64-bit integer and ``i`` the element's index in the flat tensor.
"""

from __future__ import annotations

import torch

__all__ = ["MASK32", "lowbias32", "counter_hash", "uniform_from_counter", "rotation_signs", "normalize_seed", "seed_bits"]

MASK32 = 0xFFFFFFFF
_MIX1 = 0x7FEB352D
_MIX2 = 0x846CA68B


def normalize_seed(seed: int) -> int:
    """Return ``seed`` as an unsigned 64-bit integer; raises TypeError for non-integers."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed={seed!r}: must be an int")
    return seed & 0xFFFFFFFFFFFFFFFF


def seed_bits(seed: int) -> int:
    """Return the int64 holding ``seed``'s unsigned 64-bit pattern (``seed - 2**64`` from ``2**63`` on).

    Seeds cross into the codec ops (whose schema ``int`` is signed) and into seed tables this way;
    the kernels read the bits back as unsigned.
    """
    seed = normalize_seed(seed)
    return seed - (1 << 64) if seed >= (1 << 63) else seed


def lowbias32(x: torch.Tensor) -> torch.Tensor:
    """Apply the 32-bit mixer to an int64 tensor holding values in [0, 2**32)."""
    # int64 products wrap modulo 2**64, so masking keeps exactly the uint32 product.
    x = x ^ (x >> 16)
    x = (x * _MIX1) & MASK32
    x = x ^ (x >> 15)
    x = (x * _MIX2) & MASK32
    return x ^ (x >> 16)


def _lowbias32_int(x: int) -> int:
    x &= MASK32
    x ^= x >> 16
    x = (x * _MIX1) & MASK32
    x ^= x >> 15
    x = (x * _MIX2) & MASK32
    return x ^ (x >> 16)


def counter_hash(seed: int, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Return ``hash(seed, i)`` for ``i in range(numel)`` as int64 values in [0, 2**32)."""
    seed = normalize_seed(seed)
    index = torch.arange(numel, dtype=torch.int64, device=device)
    seed_lo, seed_hi = seed & MASK32, seed >> 32
    index_hi = index >> 32
    if numel <= (1 << 32):
        key = torch.full_like(index, seed_lo ^ _lowbias32_int(seed_hi))
    else:
        key = seed_lo ^ lowbias32((index_hi + seed_hi) & MASK32)
    return lowbias32((index & MASK32) ^ key)


def uniform_from_counter(seed: int, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Return ``u(seed, i)`` for ``i in range(numel)`` as an fp32 tensor in [0, 1)."""
    return (counter_hash(seed, numel, device) >> 8).to(torch.float32) * (2.0**-24)


def rotation_signs(seed: int, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Return ``sign(seed, i)`` for ``i in range(numel)`` as fp64 +-1: bit 0 of the rounding hash.

    The rounding offset ``u`` uses the top 24 bits of the same hash, so a rotated encode computes one
    hash per element for both.
    """
    return 1.0 - 2.0 * (counter_hash(seed, numel, device) & 1).to(torch.float64)
