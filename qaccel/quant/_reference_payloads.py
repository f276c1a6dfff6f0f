"""The fused payload codecs of the specification: every segment of every slot, one call each.

Each quantized segment is exactly :func:`~qaccel.quant.reference.quantize_buckets` of that segment
alone (rotated first when the spec says so); the layout is :class:`qaccel.quant.PayloadSpec`'s. Part
of the reference; import these functions from :mod:`qaccel.quant.reference`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ._reference_buckets import dequantize_into, quantize_buckets
from ._reference_rotation import hadamard_rotate

if TYPE_CHECKING:
    from ._payload import PayloadSpec

__all__ = ["encode_payloads", "decode_payloads", "sum_payloads"]


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
