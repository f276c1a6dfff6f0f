"""The bucketed k-bit codec of the specification: steps 1-6 of :mod:`qaccel.quant.reference`.

Metadata rounded outward, codes from the counter-based rounding noise, little-endian bit packing.
Part of the reference (the pure-torch ground truth every native kernel matches bit for bit); import
these functions from :mod:`qaccel.quant.reference`.
"""

from __future__ import annotations

import math

import torch

from ._rng import uniform_from_counter

__all__ = ["round_down_to", "round_up_to", "pack_codes", "unpack_codes", "quantize_buckets", "dequantize_into"]

_NAN32 = float("nan")


def _pad_to_buckets(x: torch.Tensor, bucket_size: int, fill: float) -> torch.Tensor:
    num_buckets = math.ceil(x.numel() / bucket_size)
    padded = x.new_full((num_buckets * bucket_size,), fill)
    padded[: x.numel()] = x
    return padded.view(num_buckets, bucket_size)  # (num_buckets, bucket_size)


def round_down_to(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round fp64/fp32 ``values`` toward -inf into ``dtype`` (float32 or bfloat16)."""
    rounded = values.to(dtype)
    too_big = rounded.double() > values.double()
    if too_big.any():
        stepped = torch.nextafter(rounded, torch.full_like(rounded, -math.inf))
        rounded = torch.where(too_big, stepped, rounded)
    return rounded


def round_up_to(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round fp64/fp32 ``values`` toward +inf into ``dtype`` (float32 or bfloat16)."""
    rounded = values.to(dtype)
    too_small = rounded.double() < values.double()
    if too_small.any():
        stepped = torch.nextafter(rounded, torch.full_like(rounded, math.inf))
        rounded = torch.where(too_small, stepped, rounded)
    return rounded


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in ``[0, 2**bits)`` into uint8 groups of ``bits`` bytes per 8 codes."""
    numel = codes.numel()
    groups = math.ceil(numel / 8)
    padded = torch.zeros(groups * 8, dtype=torch.int64, device=codes.device)
    padded[:numel] = codes.reshape(-1).to(torch.int64)
    padded = padded.view(groups, 8)  # (groups, 8)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    # For bits == 8 the top code lands in the sign bit; two's complement keeps the bytes right.
    word = (padded << shifts).sum(dim=1, keepdim=True)  # (groups, 1)
    byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    return ((word >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)  # (groups * bits,)


def unpack_codes(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`; returns int64 codes of length ``numel``."""
    groups = math.ceil(numel / 8)
    grouped = packed[: groups * bits].to(torch.int64).view(groups, bits)  # (groups, bits)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    word = (grouped << byte_shifts).sum(dim=1, keepdim=True)  # (groups, 1)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    codes = (word >> shifts) & ((1 << bits) - 1)  # (groups, 8)
    return codes.reshape(-1)[:numel]


def _bucket_metadata(
    xf: torch.Tensor, bits: int, bucket_size: int, meta_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(lo_m, scale_m, finite)`` per bucket following steps 1-3 of the module doc."""
    levels = (1 << bits) - 1
    lo = _pad_to_buckets(xf, bucket_size, math.inf).amin(dim=1)
    hi = _pad_to_buckets(xf, bucket_size, -math.inf).amax(dim=1)
    finite = torch.isfinite(lo) & torch.isfinite(hi)
    lo = torch.where(finite, lo, torch.zeros_like(lo))
    hi = torch.where(finite, hi, torch.zeros_like(hi))
    lo_m = round_down_to(lo, meta_dtype)
    scale = round_up_to((hi.double() - lo_m.double()) / levels, meta_dtype)
    scale = torch.where(finite, scale, torch.full_like(scale, _NAN32))
    return lo_m, scale, finite


def quantize_buckets(
    x: torch.Tensor,
    bits: int,
    bucket_size: int,
    nearest: bool,
    seed: int,
    meta_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a flat tensor; returns ``(packed_codes, lo, scale)``. Arguments are pre-validated."""
    xf = x.reshape(-1).to(torch.float32)
    numel = xf.numel()
    if numel == 0:
        empty_meta = torch.empty(0, dtype=meta_dtype, device=x.device)
        return torch.empty(0, dtype=torch.uint8, device=x.device), empty_meta, empty_meta.clone()
    levels = (1 << bits) - 1
    lo_m, scale_m, finite = _bucket_metadata(xf, bits, bucket_size, meta_dtype)
    scale64 = scale_m.double()
    inv = torch.where(finite & (scale64 > 0), 1.0 / scale64, torch.zeros_like(scale64))
    bucket_of = torch.arange(numel, device=x.device) // bucket_size
    y = (xf.double() - lo_m.double()[bucket_of]) * inv[bucket_of]
    if nearest:
        u = torch.full((numel,), 0.5, dtype=torch.float64, device=x.device)
    else:
        u = uniform_from_counter(seed, numel, x.device).double()
    q = torch.floor(y + u).clamp_(0, levels)
    # NaN y arises only when bf16 metadata overflows (|min| > 3.3895e38): lo_m = -inf, scale inf.
    # Such a bucket decodes to NaN whatever its codes; code 0 keeps the bytes defined.
    q = torch.where(finite[bucket_of] & ~q.isnan(), q, torch.zeros_like(q))
    return pack_codes(q.to(torch.int64), bits), lo_m, scale_m


def dequantize_into(
    codes: torch.Tensor,
    lo: torch.Tensor,
    scale: torch.Tensor,
    bits: int,
    bucket_size: int,
    out: torch.Tensor,
    accumulate: bool,
) -> torch.Tensor:
    """Decode into the flat, contiguous ``out`` (fp32/bf16/fp16), overwriting or adding."""
    numel = out.numel()
    if numel == 0:
        return out
    q = unpack_codes(codes, bits, numel).double()
    bucket_of = torch.arange(numel, device=out.device) // bucket_size
    decoded = (lo.double()[bucket_of] + scale.double()[bucket_of] * q).to(torch.float32)
    if accumulate:
        decoded = out.to(torch.float32) + decoded
    out.copy_(decoded)
    return out
