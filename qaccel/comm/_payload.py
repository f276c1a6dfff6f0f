"""The byte layout of one rank-chunk on the wire, and the per-segment encode / decode over it.

Wire format of one rank-chunk (``docs/qsdp.md``, "Wire format"): a uint8 blob of a size that
depends only on the chunk's :class:`PayloadLayout`, so it is identical on every rank and one
``all_gather_single`` / ``all_to_all_single`` moves codes and metadata together::

    [ packed codes of every quantized segment | pad to 4 B | lo of every bucket | scale of every
      bucket | raw segments in the element dtype | pad to 4 B ]

Buckets restart at every segment boundary, so a LayerNorm gain never shares a grid with a weight
matrix. Raw segments (1-D or tiny parameters) travel unquantized. The codec maths lives in
:mod:`qaccel.quant`; this module only says where each part of a chunk sits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

from ..quant import PayloadSpec, QuantizedTensor, dequantize, quantize
from ..quant import packed_code_bytes as _packed_code_bytes

__all__ = ["WireCodec", "PayloadLayout", "SegmentOffsets", "mix_seed", "seed_table", "encode_chunk", "decode_chunk"]

_MASK64 = (1 << 64) - 1
_META_ITEMSIZE = {torch.float32: 4, torch.bfloat16: 2}


def mix_seed(*parts: int) -> int:
    """Hash integers into one unsigned 64-bit seed (splitmix64 chain); equal inputs, equal seed.

    Used to derive one independent rounding stream per (seed, step, unit, owner, direction,
    destination, segment), so no two codec calls share noise.
    """
    state = 0x9E3779B97F4A7C15
    for part in parts:
        state = (state ^ (int(part) & _MASK64)) & _MASK64
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        state = z ^ (z >> 31)
    return state


def seed_table(slot_seeds: list[int], num_segments: int) -> torch.Tensor:
    """``[slots, segments]`` int64 holding the uint64 bits of ``mix_seed(slot_seed, segment)``."""
    rows = []
    for slot_seed in slot_seeds:
        row = []
        for index in range(num_segments):
            value = mix_seed(slot_seed, index)
            row.append(value - (1 << 64) if value >= (1 << 63) else value)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64).reshape(len(slot_seeds), num_segments)


@dataclass(frozen=True)
class WireCodec:
    """How one direction quantizes: bit width, bucket length, metadata dtype, rounding and bucket rotation."""

    bits: int
    bucket_size: int
    meta_dtype: torch.dtype = torch.float32
    rounding: str = "stochastic"
    rotation: str = "none"

    @property
    def meta_itemsize(self) -> int:
        return _META_ITEMSIZE[self.meta_dtype]


def _align4(n: int) -> int:
    return (n + 3) // 4 * 4


class SegmentOffsets(NamedTuple):
    """Where every segment of a chunk starts, per part of the blob, and the parts' totals."""

    elem: tuple[int, ...]  # in the flat chunk, elements
    code: tuple[int, ...]  # in the packed codes, bytes
    bucket: tuple[int, ...]  # in the lo / scale arrays, buckets
    raw: tuple[int, ...]  # in the raw part, bytes
    numel: int
    code_bytes: int
    num_buckets: int
    raw_bytes: int


@dataclass(frozen=True)
class PayloadLayout:
    """Byte layout of one rank-chunk: which element ranges are quantized and where each part sits.

    Args:
        segments: ``(numel, is_quantized)`` per segment, in buffer order; they tile the chunk.
        codec: the quantizer for the quantized segments.
        elem_dtype: dtype of the flat buffer (raw segments travel in it).
    """

    segments: tuple[tuple[int, bool], ...]
    codec: WireCodec
    elem_dtype: torch.dtype

    def __post_init__(self) -> None:
        for numel, _ in self.segments:
            if numel < 0:
                raise ValueError(f"PayloadLayout: negative segment length {numel}")

    @cached_property
    def offsets(self) -> SegmentOffsets:
        """Every segment's offsets, computed once: the layout is reused for every call of a unit."""
        elem_offsets, code_offsets, bucket_offsets, raw_offsets = [], [], [], []
        elem = codes = buckets = raw = 0
        for numel, is_quantized in self.segments:
            elem_offsets.append(elem)
            code_offsets.append(codes)
            bucket_offsets.append(buckets)
            raw_offsets.append(raw)
            elem += numel
            if is_quantized:
                codes += _packed_code_bytes(numel, self.codec.bits)
                buckets += math.ceil(numel / self.codec.bucket_size)
            else:
                raw += numel * self.elem_itemsize
        return SegmentOffsets(tuple(elem_offsets), tuple(code_offsets), tuple(bucket_offsets), tuple(raw_offsets), elem, codes, buckets, raw)

    @property
    def numel(self) -> int:
        return self.offsets.numel

    @property
    def code_bytes(self) -> int:
        return self.offsets.code_bytes

    @property
    def num_buckets(self) -> int:
        return self.offsets.num_buckets

    @property
    def raw_bytes(self) -> int:
        return self.offsets.raw_bytes

    @property
    def elem_itemsize(self) -> int:
        return torch.empty((), dtype=self.elem_dtype).element_size()

    @cached_property
    def spec(self) -> PayloadSpec:
        """The same layout for the fused codec calls of :mod:`qaccel.quant` (built once per layout)."""
        codec = self.codec
        return PayloadSpec(
            segments=tuple((int(n), bool(q)) for n, q in self.segments),
            bits=codec.bits,
            bucket_size=codec.bucket_size,
            meta_dtype=codec.meta_dtype,
            rounding=codec.rounding,
            elem_dtype=self.elem_dtype,
            rotation=codec.rotation,
        )

    @property
    def meta_offset(self) -> int:
        return _align4(self.code_bytes)

    @property
    def raw_offset(self) -> int:
        return self.meta_offset + 2 * self.codec.meta_itemsize * self.num_buckets

    @property
    def nbytes(self) -> int:
        """Blob size: ``align4(codes) + 2*meta*buckets + align4(raw)`` (section 3.2 plus padding)."""
        return self.raw_offset + _align4(self.raw_bytes)

    def meta_views(self, blob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``lo`` and ``scale`` arrays of every bucket, as views of ``blob``."""
        meta_bytes = self.codec.meta_itemsize * self.num_buckets
        lo = blob[self.meta_offset : self.meta_offset + meta_bytes].view(self.codec.meta_dtype)
        scale = blob[self.meta_offset + meta_bytes : self.raw_offset].view(self.codec.meta_dtype)
        return lo, scale

    def raw_view(self, blob: torch.Tensor, index: int) -> torch.Tensor:
        """Raw segment ``index`` of ``blob``, in the element dtype."""
        start = self.raw_offset + self.offsets.raw[index]
        numel = self.segments[index][0]
        return blob[start : start + numel * self.elem_itemsize].view(self.elem_dtype)

    def quantized_view(self, blob: torch.Tensor, index: int, lo: torch.Tensor, scale: torch.Tensor) -> QuantizedTensor:
        """Quantized segment ``index`` of ``blob`` (codes and its buckets' ``lo`` / ``scale``), as views."""
        numel = self.segments[index][0]
        codes_start = self.offsets.code[index]
        first = self.offsets.bucket[index]
        count = math.ceil(numel / self.codec.bucket_size)
        return QuantizedTensor(
            codes=blob[codes_start : codes_start + _packed_code_bytes(numel, self.codec.bits)],
            lo=lo[first : first + count],
            scale=scale[first : first + count],
            numel=numel,
            bits=self.codec.bits,
            bucket_size=self.codec.bucket_size,
            dtype=self.elem_dtype,
            shape=torch.Size([numel]),
        )


def encode_chunk(chunk: torch.Tensor, layout: PayloadLayout, seed: int, out: torch.Tensor) -> torch.Tensor:
    """Write the payload of the flat ``chunk`` into the uint8 ``out`` (``layout.nbytes`` long).

    Segment ``i`` is rounded with seed ``mix_seed(seed, i)``, so segments draw independent noise.
    """
    if chunk.numel() != layout.numel:
        raise ValueError(f"encode_chunk: chunk has {chunk.numel()} elements, layout expects {layout.numel}")
    if out.numel() != layout.nbytes or out.dtype != torch.uint8:
        raise ValueError(f"encode_chunk: out must be uint8 with {layout.nbytes} bytes")
    lo_all, scale_all = layout.meta_views(out)
    codec = layout.codec
    for index, (numel, is_quantized) in enumerate(layout.segments):
        start = layout.offsets.elem[index]
        segment = chunk[start : start + numel]
        if not is_quantized:
            layout.raw_view(out, index).copy_(segment)
            continue
        q = quantize(segment, codec.bits, codec.bucket_size, codec.rounding, mix_seed(seed, index), codec.meta_dtype)
        view = layout.quantized_view(out, index, lo_all, scale_all)
        view.codes.copy_(q.codes)
        view.lo.copy_(q.lo)
        view.scale.copy_(q.scale)
    # Padding bytes are zeroed so that blobs are deterministic byte for byte.
    out[layout.code_bytes : layout.meta_offset].zero_()
    out[layout.raw_offset + layout.raw_bytes :].zero_()
    return out


def decode_chunk(blob: torch.Tensor, layout: PayloadLayout, out: torch.Tensor, accumulate: bool = False) -> torch.Tensor:
    """Decode a payload into the flat, contiguous ``out``; with ``accumulate`` add into it (fp32 sum)."""
    lo_all, scale_all = layout.meta_views(blob)
    for index, (numel, is_quantized) in enumerate(layout.segments):
        start = layout.offsets.elem[index]
        target = out[start : start + numel]
        if is_quantized:
            dequantize(layout.quantized_view(blob, index, lo_all, scale_all), out=target, accumulate=accumulate)
        elif accumulate:
            target.add_(layout.raw_view(blob, index).to(target.dtype))
        else:
            target.copy_(layout.raw_view(blob, index))
    return out
