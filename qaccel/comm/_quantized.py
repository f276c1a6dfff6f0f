"""Quantized all-gather and all-to-all reduce-scatter over a process group, with exact byte counts.

Wire format of one rank-chunk (``docs/qsdp.md``, "Wire format"): a uint8 blob of a size that
depends only on the chunk's :class:`PayloadLayout`, so it is identical on every rank and one
``all_gather_into_tensor`` / ``all_to_all_single`` moves codes and metadata together::

    [ packed codes of every quantized segment | pad to 4 B | lo of every bucket | scale of every
      bucket | raw segments in the element dtype | pad to 4 B ]

Buckets restart at every segment boundary, so a LayerNorm gain never shares a grid with a weight
matrix. Raw segments (1-D or tiny parameters) travel unquantized. The codec maths lives in
:mod:`qaccel.quant`; this module only lays bytes out, moves them and records them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..quant import QuantizedTensor, dequantize, quantize
from ..quant import packed_code_bytes as _packed_code_bytes
from ._accounting import WireMeter

__all__ = [
    "WireCodec",
    "PayloadLayout",
    "mix_seed",
    "encode_chunk",
    "decode_chunk",
    "quantized_all_gather",
    "quantized_reduce_scatter",
    "counted_all_gather",
    "counted_reduce_scatter",
]

_MASK64 = (1 << 64) - 1
_META_ITEMSIZE = {torch.float32: 4, torch.bfloat16: 2}


def _all_gather_single():
    """torch >= 2.10 names the flat collectives ``*_single`` (FSDP2's defaults call them); older: ``*_tensor``.

    Looked up at call time, like FSDP2's own comms do, so a wrapper around the torch function (a
    profiler, or a test counting the bytes handed to the collective) sees our calls too.
    """
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_single():
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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


@dataclass(frozen=True)
class WireCodec:
    """How one direction quantizes: bit width, bucket length, metadata dtype and rounding."""

    bits: int
    bucket_size: int
    meta_dtype: torch.dtype = torch.float32
    rounding: str = "stochastic"

    @property
    def meta_itemsize(self) -> int:
        return _META_ITEMSIZE[self.meta_dtype]


def _align4(n: int) -> int:
    return (n + 3) // 4 * 4


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
        # Precompute offsets once; the layout is reused for every call of a unit.
        elem_offsets, code_offsets, bucket_offsets, raw_offsets = [], [], [], []
        elem = codes = buckets = raw = 0
        for numel, is_quantized in self.segments:
            if numel < 0:
                raise ValueError(f"PayloadLayout: negative segment length {numel}")
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
        object.__setattr__(self, "_elem_offsets", tuple(elem_offsets))
        object.__setattr__(self, "_code_offsets", tuple(code_offsets))
        object.__setattr__(self, "_bucket_offsets", tuple(bucket_offsets))
        object.__setattr__(self, "_raw_offsets", tuple(raw_offsets))
        object.__setattr__(self, "numel", elem)
        object.__setattr__(self, "code_bytes", codes)
        object.__setattr__(self, "num_buckets", buckets)
        object.__setattr__(self, "raw_bytes", raw)

    @property
    def elem_itemsize(self) -> int:
        return torch.empty((), dtype=self.elem_dtype).element_size()

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

    def _meta_views(self, blob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        meta_bytes = self.codec.meta_itemsize * self.num_buckets
        lo = blob[self.meta_offset : self.meta_offset + meta_bytes].view(self.codec.meta_dtype)
        scale = blob[self.meta_offset + meta_bytes : self.raw_offset].view(self.codec.meta_dtype)
        return lo, scale

    def _raw_view(self, blob: torch.Tensor, index: int) -> torch.Tensor:
        start = self.raw_offset + self._raw_offsets[index]
        numel = self.segments[index][0]
        return blob[start : start + numel * self.elem_itemsize].view(self.elem_dtype)

    def _quantized_view(self, blob: torch.Tensor, index: int, lo: torch.Tensor, scale: torch.Tensor) -> QuantizedTensor:
        numel = self.segments[index][0]
        codes_start = self._code_offsets[index]
        first = self._bucket_offsets[index]
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
    lo_all, scale_all = layout._meta_views(out)
    codec = layout.codec
    for index, (numel, is_quantized) in enumerate(layout.segments):
        start = layout._elem_offsets[index]
        segment = chunk[start : start + numel]
        if not is_quantized:
            layout._raw_view(out, index).copy_(segment)
            continue
        q = quantize(segment, codec.bits, codec.bucket_size, codec.rounding, mix_seed(seed, index), codec.meta_dtype)
        view = layout._quantized_view(out, index, lo_all, scale_all)
        view.codes.copy_(q.codes)
        view.lo.copy_(q.lo)
        view.scale.copy_(q.scale)
    # Padding bytes are zeroed so that blobs are deterministic byte for byte.
    out[layout.code_bytes : layout.meta_offset].zero_()
    out[layout.raw_offset + layout.raw_bytes :].zero_()
    return out


def decode_chunk(blob: torch.Tensor, layout: PayloadLayout, out: torch.Tensor, accumulate: bool = False) -> torch.Tensor:
    """Decode a payload into the flat, contiguous ``out``; with ``accumulate`` add into it (fp32 sum)."""
    lo_all, scale_all = layout._meta_views(blob)
    for index, (numel, is_quantized) in enumerate(layout.segments):
        start = layout._elem_offsets[index]
        target = out[start : start + numel]
        if is_quantized:
            dequantize(layout._quantized_view(blob, index, lo_all, scale_all), out=target, accumulate=accumulate)
        elif accumulate:
            target.add_(layout._raw_view(blob, index).to(target.dtype))
        else:
            target.copy_(layout._raw_view(blob, index))
    return out


def quantized_all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    layout: PayloadLayout,
    seed: int,
    meter: WireMeter,
    kind: str,
) -> None:
    """All-gather quantized chunks: every rank, the owner too, decodes the same bytes.

    ``input`` may alias ``output[rank*S:(rank+1)*S]`` (FSDP2 does this), so it is encoded before
    ``output`` is written. Bytes recorded: ``(P-1) * layout.nbytes`` each way.
    """
    world, rank = group.size(), group.rank()
    chunk_numel = input.numel()
    if output.numel() != world * chunk_numel:
        raise ValueError(f"quantized_all_gather (rank {rank}/{world}): output has {output.numel()} elements, expected {world * chunk_numel}")
    blob = torch.empty(layout.nbytes, dtype=torch.uint8, device=input.device)
    encode_chunk(input.reshape(-1), layout, seed, blob)
    gathered = torch.empty(world * layout.nbytes, dtype=torch.uint8, device=input.device)
    _all_gather_single()(gathered, blob, group=group)
    meter.record(kind, sent_bytes=(world - 1) * layout.nbytes, recv_bytes=(world - 1) * layout.nbytes)
    flat_out = output.view(-1)
    for owner in range(world):
        decode_chunk(
            gathered[owner * layout.nbytes : (owner + 1) * layout.nbytes],
            layout,
            flat_out[owner * chunk_numel : (owner + 1) * chunk_numel],
        )


def quantized_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    layout: PayloadLayout,
    seeds: list[int],
    meter: WireMeter,
    kind: str,
    divide_factor: float = 1.0,
) -> None:
    """Reduce-scatter by all-to-all of quantized chunks and an fp32 sum (divided by ``divide_factor``).

    ``input`` holds ``P`` rank-ordered chunks; chunk ``j`` is encoded with ``seeds[j]`` and sent to
    rank ``j``. The own chunk never leaves the rank and is added exactly. With the default
    ``divide_factor=1`` this is a SUM; FSDP2 does its averaging afterwards. Bytes recorded:
    ``(P-1) * layout.nbytes`` each way (a zero-length split for self keeps it off the wire).
    """
    world, rank = group.size(), group.rank()
    chunk_numel = output.numel()
    if input.numel() != world * chunk_numel or len(seeds) != world:
        raise ValueError(
            f"quantized_reduce_scatter (rank {rank}/{world}): input has {input.numel()} elements and "
            f"{len(seeds)} seeds, expected {world * chunk_numel} and {world}"
        )
    chunks = input.view(world, chunk_numel)  # (world, chunk_numel), chunk j belongs to rank j
    others = [j for j in range(world) if j != rank]
    send = torch.empty(len(others) * layout.nbytes, dtype=torch.uint8, device=input.device)
    for slot, dest in enumerate(others):
        encode_chunk(chunks[dest], layout, seeds[dest], send[slot * layout.nbytes : (slot + 1) * layout.nbytes])
    recv = torch.empty_like(send)
    splits = [0 if j == rank else layout.nbytes for j in range(world)]
    dist.all_to_all_single(recv, send, output_split_sizes=splits, input_split_sizes=splits, group=group)
    meter.record(kind, sent_bytes=send.numel(), recv_bytes=recv.numel())
    total = chunks[rank].to(torch.float32, copy=True)
    for slot in range(len(others)):
        decode_chunk(recv[slot * layout.nbytes : (slot + 1) * layout.nbytes], layout, total, accumulate=True)
    if divide_factor != 1:
        total.div_(divide_factor)
    output.view(-1).copy_(total)


def counted_all_gather(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, meter: WireMeter, kind: str, async_op: bool = False
) -> dist.Work | None:
    """Plain ``all_gather_into_tensor`` (what FSDP2 issues) that records ``(P-1)*S*itemsize`` each way."""
    nbytes = (group.size() - 1) * input.numel() * input.element_size()
    meter.record(kind, sent_bytes=nbytes, recv_bytes=nbytes)
    # The same call FSDP2's DefaultAllGather makes, so the pass-through is bit-identical to stock.
    return _all_gather_single()(output, input, group=group, async_op=async_op)


def counted_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    op: dist.ReduceOp,
    meter: WireMeter,
    kind: str,
    async_op: bool = False,
) -> dist.Work | None:
    """Plain ``reduce_scatter_tensor`` with FSDP's op, recording ``(P-1)*S*itemsize`` each way."""
    nbytes = (group.size() - 1) * output.numel() * output.element_size()
    meter.record(kind, sent_bytes=nbytes, recv_bytes=nbytes)
    return _reduce_scatter_single()(output, input, op=op, group=group, async_op=async_op)
