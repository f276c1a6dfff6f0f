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

Fused 1-bit error feedback (:func:`onebit_encode`, :func:`onebit_server`): one side of the 1-bit
all-reduce each, exactly the sequence of codec calls ``qaccel.comm._onebit`` made before they were
fused. The scale (``torch.linalg.vector_norm``) and the server's sum over ranks (``torch.sum``) reduce
in torch's own order, which depends on sizes and thread counts: the native kernels call those torch
ops and fuse everything else into their passes.
"""

from __future__ import annotations

import math

import torch

# The specification's code lives by concern beside this module; these are its public functions.
from ._reference_buckets import dequantize_into, pack_codes, quantize_buckets, round_down_to, round_up_to, unpack_codes
from ._reference_payloads import decode_payloads, encode_payloads, sum_payloads
from ._reference_rotation import hadamard_rotate

__all__ = [
    "quantize_buckets",
    "dequantize_into",
    "pack_codes",
    "unpack_codes",
    "sign_pack",
    "sign_unpack",
    "chunk_rms",
    "onebit_encode",
    "onebit_server",
    "encode_payloads",
    "decode_payloads",
    "sum_payloads",
    "round_down_to",
    "round_up_to",
    "hadamard_rotate",
]


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


def _compress_with_error(values: torch.Tensor, error: torch.Tensor, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sign-compress the compensated ``values``; ``error`` becomes ``values - decode(signs, scales)``."""
    signs = sign_pack(values, chunks)
    scales = chunk_rms(values, chunks)
    decoded = sign_unpack(signs, scales, values.numel(), torch.empty_like(values))
    error.copy_(values - decoded)
    return signs, scales


def onebit_encode(x: torch.Tensor, error: torch.Tensor, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker side: ``c = pad(fp32(x)) + error``; returns ``(sign_pack(c), chunk_rms(c))`` and sets
    ``error = c - decode`` (``error``: flat fp32 of ``M' >= x.numel()`` elements, ``chunks`` dividing ``M'``)."""
    compensated = torch.zeros(error.numel(), dtype=torch.float32, device=error.device)
    compensated[: x.numel()] = x.reshape(-1)
    compensated.add_(error)
    return _compress_with_error(compensated, error, chunks)


def onebit_server(
    signs: torch.Tensor, scales: torch.Tensor, error: torch.Tensor, chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Server side: decode the ``N = scales.numel()`` workers' chunks of ``n = error.numel()`` elements
    (``signs``: ``N`` rows of ``ceil(n/8)`` bytes) with scales ``s_i * (1/N)``, sum them over the
    workers, add ``error``; returns the compressed sum as :func:`onebit_encode` does and sets ``error``."""
    world, numel = scales.numel(), error.numel()
    decoded = torch.empty((world, numel), dtype=torch.float32, device=error.device)
    # (s_w / N) first, then times +-1: the order of DeepSpeed's server average
    sign_unpack(signs.reshape(-1), scales * (1 / world), world * numel, decoded.view(-1))
    averaged = decoded.sum(0)
    averaged.add_(error)
    return _compress_with_error(averaged, error, chunks)
