"""Pure-torch reference codecs: the specification every native backend must match bit for bit.

Bucketed k-bit quantizer (QSDP, Markov et al. 2023; ``docs/qsdp.md``, "Wire format"). For a
flat tensor split into buckets of ``bucket_size`` elements (the last may be short) and
``L = 2**bits - 1``:

1. ``lo = min(bucket)``, ``hi = max(bucket)`` in fp32.
2. Metadata is rounded *outward* to ``meta_dtype``: ``lo_m = round_down(lo)``,
   ``scale_m = round_up((double(hi) - double(lo_m)) / L)``. The grid ``lo_m + scale_m * q``
   therefore always covers ``[min, max]`` and encoder and decoder use the same grid. fp32
   metadata keeps ``lo`` exact. The difference is taken in double so ``hi - lo`` never overflows.
3. A bucket holding NaN or +-Inf gets ``lo_m = 0``, ``scale_m = NaN`` and all codes 0, so every
   element of it decodes to NaN (loss scalers and skip logic still see the overflow). With bf16
   metadata a finite bucket whose min lies below -3.3895e38 (the largest bf16) overflows its grid
   (``lo_m = -inf``): its codes are 0 and it decodes to NaN too, never to a finite value. The sign
   of a zero min/max (+0.0 vs -0.0) is unspecified; values and decoded outputs do not depend on it.
4. Encode in double: ``inv = 1 / scale_m`` (0 when ``scale_m == 0``),
   ``y = (x - lo_m) * inv``, ``q = clamp(floor(y + u), 0, L)`` where ``u`` is
   ``_rng.uniform_from_counter(seed, i)`` (stochastic, unbiased) or 0.5 (nearest).
5. Decode: ``x_hat = fp32(double(lo_m) + double(scale_m) * q)`` (the product is exact, so the
   result is ``lo_m + scale_m * q`` rounded once). Accumulation adds ``x_hat`` to ``out`` in fp32 and
   rounds the sum to ``out``'s dtype.
6. Packing: eight codes form a group of ``bits`` bytes read as a little-endian integer; code ``j`` of
   the group sits at bits ``[bits*j, bits*j + bits)``. The last group is padded with code 0.

Rotation (payload codecs with ``PayloadSpec.rotation == "hadamard"``; ``docs/kernels.md``,
"Hadamard rotation"). A quantized segment of ``n`` elements rounded with seed ``s`` is rotated
bucket by bucket before step 1, and the decoded values are rotated back after step 5; bytes and
layout do not change:

7. Each bucket is tiled by power-of-two blocks (:func:`qaccel.quant._types.rotation_blocks`: the
   largest power of two not above what is left, at most ``ROTATION_MAX_BLOCK`` = 1024).
8. Signs: ``d_i = -1 if hash(s, i) & 1 else +1`` for the element's index ``i`` in the segment (bit 0
   of the rounding hash, ``qaccel.quant._rng``).
9. Forward, per block of length ``b`` with ``c = 1.0 / sqrt(double(b))`` (both correctly rounded):
   ``w_i = double(fp32(x_i)) * d_i``; the Walsh-Hadamard butterflies in double for
   ``h = 1, 2, 4, ..., b/2``: every pair ``(j, j + h)`` with ``j & h == 0`` (block-local ``j``)
   becomes ``(w_j + w_{j+h}, w_j - w_{j+h})``; then ``r_i = fp32(w_i * c)``. Steps 1-4 quantize
   ``r`` (metadata from ``r``; the rounding offset of ``r_i`` is ``u(s, i)`` as before).
10. Inverse, after step 5 (``y_i`` the decoded fp32 value): ``w_i = double(y_i)``, the same
    butterflies, then ``x_hat_i = fp32((w_i * c) * d_i)``, written or accumulated as in step 5.
    A NaN bucket decodes to NaN in every element of its blocks.

1-bit sign codec (0/1 Adam, ``docs/zero_one_adam.md``, "Wire format of the 1-bit all-reduce"): see
:class:`qaccel.quant.SignCompressed` for the layout; the scale of a chunk is
``torch.linalg.vector_norm(chunk) / sqrt(n_c)`` in fp32, as DeepSpeed computes it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ._rng import rotation_signs, uniform_from_counter
from ._types import rotation_blocks

if TYPE_CHECKING:
    from ._payload import PayloadSpec

__all__ = [
    "quantize_buckets",
    "dequantize_into",
    "pack_codes",
    "unpack_codes",
    "sign_pack",
    "sign_unpack",
    "chunk_rms",
    "encode_payloads",
    "decode_payloads",
    "sum_payloads",
    "round_down_to",
    "round_up_to",
    "hadamard_rotate",
]

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


def chunk_rms(x: torch.Tensor, chunks: int) -> torch.Tensor:
    """``||x_c||_2 / sqrt(n_c)`` per equal chunk, fp32 (DeepSpeed's 1-bit scale)."""
    xf = x.reshape(-1).to(torch.float32)
    if xf.numel() == 0:
        return torch.zeros(chunks, dtype=torch.float32, device=x.device)
    chunk_numel = xf.numel() // chunks
    if chunks == 1:
        return (torch.linalg.vector_norm(xf) / math.sqrt(chunk_numel)).reshape(1)
    return torch.linalg.vector_norm(xf.view(chunks, chunk_numel), dim=1) / math.sqrt(chunk_numel)


def sign_pack(x: torch.Tensor, chunks: int) -> torch.Tensor:
    """Pack ``x >= 0`` as bits, MSB first, each chunk padded to whole bytes."""
    xf = x.reshape(-1)
    if xf.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=x.device)
    chunk_numel = xf.numel() // chunks
    chunk_bytes = math.ceil(chunk_numel / 8)
    bits = torch.zeros(chunks, chunk_bytes * 8, dtype=torch.int64, device=x.device)
    bits[:, :chunk_numel] = (xf.view(chunks, chunk_numel) >= 0).to(torch.int64)
    weights = 1 << torch.arange(7, -1, -1, device=x.device, dtype=torch.int64)  # MSB first
    packed = (bits.view(chunks, chunk_bytes, 8) * weights).sum(dim=2)  # (chunks, chunk_bytes)
    return packed.to(torch.uint8).reshape(-1)


def sign_unpack(signs: torch.Tensor, scales: torch.Tensor, numel: int, out: torch.Tensor) -> torch.Tensor:
    """Write ``scale_c * (2*bit - 1)`` for every element into the flat fp32 ``out``."""
    if numel == 0:
        return out
    chunks = scales.numel()
    chunk_numel = numel // chunks
    chunk_bytes = math.ceil(chunk_numel / 8)
    shifts = torch.arange(7, -1, -1, device=signs.device, dtype=torch.int64)
    bits = (signs.view(chunks, chunk_bytes, 1).to(torch.int64) >> shifts) & 1  # (chunks, bytes, 8)
    pm_one = (bits.view(chunks, chunk_bytes * 8)[:, :chunk_numel] * 2 - 1).to(torch.float32)
    out.view(chunks, chunk_numel).copy_(pm_one * scales.to(torch.float32).view(chunks, 1))
    return out


# -- fused payloads (layout: qaccel.quant._payload.PayloadSpec) --------------------------------------


def _payload_parts(blob: torch.Tensor, spec: PayloadSpec, index: int):
    """Views of segment ``index`` in one payload: ``(codes, lo, scale)`` or the raw elements."""
    numel, quantized = spec.segments[index]
    if not quantized:
        start = spec.raw_offsets[index]
        return blob[start : start + numel * spec.elem_itemsize].view(spec.elem_dtype)
    meta_bytes = spec.meta_itemsize * spec.num_buckets
    lo_all = blob[spec.meta_offset : spec.meta_offset + meta_bytes].view(spec.meta_dtype)
    scale_all = blob[spec.meta_offset + meta_bytes : spec.raw_offset].view(spec.meta_dtype)
    first, count = spec.bucket_offsets[index], math.ceil(numel / spec.bucket_size)
    codes_start = spec.code_offsets[index]
    codes = blob[codes_start : codes_start + spec.bits * math.ceil(numel / 8)]
    return codes, lo_all[first : first + count], scale_all[first : first + count]


def encode_payloads(
    src: torch.Tensor, spec: PayloadSpec, src_offsets: Sequence[int], seeds: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Encode chunk ``src[src_offsets[s]:][:spec.numel]`` into payload ``s`` of ``out``; pre-validated.

    Segment ``i`` of slot ``s`` is quantized with the uint64 seed held (as int64 bits) in
    ``seeds[s, i]``, exactly as :func:`quantize_buckets` would on the segment alone.
    """
    nbytes = spec.nbytes
    seed_rows = seeds.tolist()
    for slot, start in enumerate(src_offsets):
        blob = out[slot * nbytes : (slot + 1) * nbytes]
        for index, (numel, quantized) in enumerate(spec.segments):
            first = int(start) + spec.elem_offsets[index]
            segment = src[first : first + numel]
            if not quantized:
                _payload_parts(blob, spec, index).copy_(segment)
                continue
            seed = seed_rows[slot][index] & 0xFFFFFFFFFFFFFFFF
            if spec.rotated:
                segment = hadamard_rotate(segment, spec.bucket_size, seed)
            codes, lo, scale = quantize_buckets(segment, spec.bits, spec.bucket_size, spec.nearest, seed, spec.meta_dtype)
            view_codes, view_lo, view_scale = _payload_parts(blob, spec, index)
            view_codes.copy_(codes)
            view_lo.copy_(lo)
            view_scale.copy_(scale)
        blob[spec.code_bytes : spec.meta_offset].zero_()
        blob[spec.raw_offset + spec.raw_bytes :].zero_()
    return out


def _decode_segment(parts, spec: PayloadSpec, seed: int | None, target: torch.Tensor, accumulate: bool) -> None:
    """Decode one quantized segment into ``target`` (overwrite or fp32 add), rotating back if rotated."""
    if not spec.rotated:
        dequantize_into(*parts, spec.bits, spec.bucket_size, target, accumulate)
        return
    rotated = torch.empty(target.numel(), dtype=torch.float32, device=target.device)
    dequantize_into(*parts, spec.bits, spec.bucket_size, rotated, False)
    decoded = hadamard_rotate(rotated, spec.bucket_size, seed, inverse=True)
    target.copy_(target.to(torch.float32) + decoded if accumulate else decoded)


def _seed_rows(seeds: torch.Tensor | None) -> list[list[int]] | None:
    return None if seeds is None else [[value & 0xFFFFFFFFFFFFFFFF for value in row] for row in seeds.tolist()]


def decode_payloads(
    blob: torch.Tensor,
    spec: PayloadSpec,
    out: torch.Tensor,
    out_offsets: Sequence[int],
    seeds: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode payload ``s`` of ``blob`` into ``out[out_offsets[s]:][:spec.numel]`` (overwrite); pre-validated.

    ``seeds`` (``[slots, segments]``, the encode's table) is read only when ``spec.rotated``.
    """
    nbytes = spec.nbytes
    seed_rows = _seed_rows(seeds)
    for slot, start in enumerate(out_offsets):
        payload = blob[slot * nbytes : (slot + 1) * nbytes]
        for index, (numel, quantized) in enumerate(spec.segments):
            first = int(start) + spec.elem_offsets[index]
            target = out[first : first + numel]
            parts = _payload_parts(payload, spec, index)
            if quantized:
                _decode_segment(parts, spec, seed_rows and seed_rows[slot][index], target, False)
            else:
                target.copy_(parts)
    return out


def sum_payloads(
    blob: torch.Tensor, spec: PayloadSpec, base: torch.Tensor, out: torch.Tensor, seeds: torch.Tensor | None = None
) -> torch.Tensor:
    """``out = base + payload_0 + payload_1 + ...`` summed in fp32 in slot order, rounded once; pre-validated.

    ``seeds`` (``[slots, segments]``, each payload's encode seeds) is read only when ``spec.rotated``.
    """
    nbytes = spec.nbytes
    seed_rows = _seed_rows(seeds)
    total = base.reshape(-1).to(torch.float32, copy=True)
    slots = blob.numel() // nbytes if nbytes else 0
    for slot in range(slots):
        payload = blob[slot * nbytes : (slot + 1) * nbytes]
        for index, (numel, quantized) in enumerate(spec.segments):
            first = spec.elem_offsets[index]
            target = total[first : first + numel]
            parts = _payload_parts(payload, spec, index)
            if quantized:
                _decode_segment(parts, spec, seed_rows and seed_rows[slot][index], target, True)
            else:
                target.add_(parts.to(torch.float32))
    out.reshape(-1).copy_(total)
    return out
