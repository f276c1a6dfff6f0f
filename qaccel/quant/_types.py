"""Value objects returned by the codecs, and the wire-size formulas they obey."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "QuantizedTensor",
    "SignCompressed",
    "packed_code_bytes",
    "quantized_nbytes",
    "sign_packed_bytes",
    "META_DTYPES",
    "ROUNDINGS",
    "ROTATIONS",
    "ROTATION_MAX_BLOCK",
    "rotation_blocks",
]

ROUNDINGS = ("stochastic", "nearest")
# Bucket rotations of the payload codecs (``reference`` module docstring, "Rotation").
ROTATIONS = ("none", "hadamard")
# Longest Hadamard block: a bucket is rotated in power-of-two blocks of at most this many elements,
# so one CUDA warp holds a block in shared memory whatever the bucket size.
ROTATION_MAX_BLOCK = 1024
# Narrow metadata is rounded outward (lo down, scale up) so the grid still covers [min, max].
META_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def packed_code_bytes(numel: int, bits: int) -> int:
    """Bytes of ``numel`` packed ``bits``-bit codes: eight codes fill exactly ``bits`` bytes."""
    return bits * math.ceil(numel / 8)


def quantized_nbytes(numel: int, bits: int, bucket_size: int, meta_dtype: torch.dtype = torch.float32) -> int:
    """Wire size of a quantized tensor: packed codes plus ``(lo, scale)`` per bucket."""
    num_buckets = math.ceil(numel / bucket_size)
    meta_itemsize = torch.empty((), dtype=meta_dtype).element_size()
    return packed_code_bytes(numel, bits) + 2 * meta_itemsize * num_buckets


def rotation_blocks(length: int) -> list[int]:
    """Power-of-two block lengths tiling a bucket of ``length`` elements, in order: the longest first.

    Each block is the largest power of two not above what is left, capped at ``ROTATION_MAX_BLOCK``
    (100 -> 64, 32, 4; 128 -> 128; 2500 -> 1024, 1024, 256, 128, 64, 4).
    """
    blocks = []
    while length > 0:
        block = min(1 << (length.bit_length() - 1), ROTATION_MAX_BLOCK)
        blocks.append(block)
        length -= block
    return blocks


def sign_packed_bytes(numel: int, chunks: int) -> int:
    """Bytes of the sign bits of ``numel`` values split in ``chunks`` equal chunks (8 per byte)."""
    return chunks * math.ceil(numel // max(chunks, 1) / 8) if numel else 0


@dataclass(frozen=True)
class QuantizedTensor:
    """A flat tensor in bucketed k-bit form.

    Attributes:
        codes: uint8, ``bits * ceil(numel / 8)`` bytes. Eight consecutive codes form a group of
            ``bits`` bytes read as a little-endian integer; code ``i`` of the group sits at bits
            ``[bits*i, bits*i + bits)``. For bits in {2, 4, 8} this is "LSB first within a byte".
            Codes past ``numel`` (padding of the last group) are zero.
        lo: per-bucket minimum (grid origin), ``meta_dtype``, shape ``(num_buckets,)``.
        scale: per-bucket grid step ``(max - min) / (2**bits - 1)``, rounded up when narrow; NaN
            marks a bucket that held a non-finite value (it decodes to NaN).
        numel: number of real elements.
        bits: code width, 2..8.
        bucket_size: elements per bucket; the last bucket may be shorter.
        dtype: dtype of the tensor that was quantized (informational).
        shape: shape of the tensor that was quantized (``dequantize`` returns this shape).
    """

    codes: torch.Tensor
    lo: torch.Tensor
    scale: torch.Tensor
    numel: int
    bits: int
    bucket_size: int
    dtype: torch.dtype
    shape: torch.Size

    @property
    def num_buckets(self) -> int:
        return self.lo.numel()

    @property
    def nbytes(self) -> int:
        """Size on the wire: codes plus both metadata arrays."""
        return self.codes.numel() + self.lo.numel() * self.lo.element_size() * 2

    def __repr__(self) -> str:
        return (
            f"QuantizedTensor(numel={self.numel}, bits={self.bits}, bucket_size={self.bucket_size}, "
            f"meta={self.lo.dtype}, nbytes={self.nbytes}, device={self.codes.device})"
        )


@dataclass(frozen=True)
class SignCompressed:
    """A flat tensor in 1-bit form: one sign bit per element and one RMS scale per chunk.

    Attributes:
        signs: uint8, chunk ``c`` occupies bytes ``[c*B, (c+1)*B)`` with ``B = ceil(n_c / 8)``
            and ``n_c = numel // chunks``. Within a byte the first element is the most significant
            bit (numpy ``packbits`` order, as DeepSpeed's 1-bit backends). Bit 1 means ``x >= 0``
            (so 0 decodes to ``+scale``); bit 0 means ``x < 0`` or NaN. Pad bits are 0.
        scales: fp32, shape ``(chunks,)``: ``||x_c||_2 / sqrt(n_c)``.
        numel: number of elements.
        chunks: number of equal chunks.
        shape: shape of the tensor that was compressed.
    """

    signs: torch.Tensor
    scales: torch.Tensor
    numel: int
    chunks: int
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        return self.signs.numel() + self.scales.numel() * self.scales.element_size()
