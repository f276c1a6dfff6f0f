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
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist

from ..quant import PayloadSpec, QuantizedTensor, decode_payloads, dequantize, encode_payloads, quantize, sum_payloads
from ..quant import packed_code_bytes as _packed_code_bytes
from ._accounting import WireMeter
from ._buffers import BufferPool
from ._phases import PhaseTimer

__all__ = [
    "WireCodec",
    "PayloadLayout",
    "mix_seed",
    "encode_chunk",
    "decode_chunk",
    "quantized_all_gather",
    "quantized_reduce_scatter",
    "DecodeOnWait",
    "counted_all_gather",
    "counted_reduce_scatter",
    "alltoall_reduce_scatter",
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


def _seed_table(slot_seeds: list[int], num_segments: int) -> torch.Tensor:
    """``[slots, segments]`` int64 holding the uint64 bits of ``mix_seed(slot_seed, segment)``."""
    rows = []
    for slot_seed in slot_seeds:
        row = []
        for index in range(num_segments):
            value = mix_seed(slot_seed, index)
            row.append(value - (1 << 64) if value >= (1 << 63) else value)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64).reshape(len(slot_seeds), num_segments)


def _rotation_seeds(
    name: str, spec: PayloadSpec, seeds: Sequence[int] | None, what: str, world: int, rank: int, own_seed: int
) -> torch.Tensor | None:
    """The decode seed table of a rotated layout: ``seeds`` in rank order, the own one checked (None unrotated)."""
    if not spec.rotated:
        return None
    if seeds is None or len(seeds) != world:
        got = "none" if seeds is None else f"{len(seeds)}"
        raise ValueError(f"{name} (rank {rank}/{world}): a rotated codec needs {what}: one seed per rank ({world}), got {got}")
    if int(seeds[rank]) != int(own_seed):
        raise ValueError(f"{name} (rank {rank}/{world}): {what}[{rank}]={seeds[rank]} differs from this rank's own seed {own_seed}")
    return _seed_table([int(value) for value in seeds], len(spec.segments))


def _staging(buffers: BufferPool | None, nbytes: int, device: torch.device) -> torch.Tensor:
    if buffers is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buffers.get(nbytes, torch.uint8, device)


@contextmanager
def _timed(timer: PhaseTimer | None, kind: str, phase: str, device: torch.device):
    if timer is None:
        yield
    else:
        with timer.phase(kind, phase, device):
            yield


class DecodeOnWait(dist.Work):
    """The work of an asynchronous collective: ``wait()`` finishes the transport, then decodes.

    FSDP2 waits on the work of a prefetched all-gather right before the unit's forward needs the
    weights, so the transport overlaps the compute in between and the decode runs once, on wait.
    ``collective`` names the ``torch.distributed`` function that started the transport: a failure
    surfaces here, outside that function, and error reports (``qaccel.training.faults``) name it.
    ``keep_alive`` holds the tensors the transport reads or writes in the background (a pooled send
    blob, FSDP2's pooled input) until ``wait()``: the transport's own references live in C++, where
    :class:`qaccel.comm.BufferPool` cannot see them, so without these the pool could hand such a
    buffer out again while gloo still reads it.
    """

    def __init__(self, transport: dist.Work, finish, collective: str, keep_alive: tuple[torch.Tensor, ...] = ()) -> None:
        super().__init__()
        self._transport = transport
        self._finish = finish
        self._keep_alive = keep_alive
        self._done = False
        self.collective = collective

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - torch's signature; the transport has its own
        if not self._done:
            self._transport.wait()
            if self._finish is not None:
                self._finish()
            self._done = True
            self._keep_alive = ()
        return True

    def is_completed(self) -> bool:
        return self._done


def quantized_all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    layout: PayloadLayout,
    seed: int,
    meter: WireMeter,
    kind: str,
    *,
    owner_seeds: Sequence[int] | None = None,
    async_op: bool = False,
    buffers: BufferPool | None = None,
    timer: PhaseTimer | None = None,
) -> DecodeOnWait | None:
    """All-gather quantized chunks: every rank, the owner too, decodes the same bytes.

    One fused encode call writes this rank's payload, one fused decode call writes every owner's
    chunk straight into ``output`` (``docs/qsdp.md``, "Fused payload kernels"). ``input`` may alias
    ``output[rank*S:(rank+1)*S]`` (FSDP2 does this): it is encoded before ``output`` is written.
    With ``async_op`` the transport runs in the background and the returned work decodes on
    ``wait()``. Bytes recorded: ``(P-1) * layout.nbytes`` each way. A rotated codec
    (``WireCodec.rotation``) needs ``owner_seeds``: the seed every rank encoded its chunk with, in
    rank order (``owner_seeds[rank] == seed``), since rotating back needs each owner's signs.
    """
    world, rank = group.size(), group.rank()
    chunk_numel = input.numel()
    if output.numel() != world * chunk_numel:
        raise ValueError(f"quantized_all_gather (rank {rank}/{world}): output has {output.numel()} elements, expected {world * chunk_numel}")
    spec, device = layout.spec, input.device
    decode_seeds = _rotation_seeds("quantized_all_gather", spec, owner_seeds, "owner_seeds", world, rank, seed)
    blob = _staging(buffers, spec.nbytes, device)
    with _timed(timer, kind, "encode", device):
        encode_payloads(input.reshape(-1), spec, [0], _seed_table([seed], len(spec.segments)), blob)
    gathered = _staging(buffers, world * spec.nbytes, device)
    meter.record(kind, sent_bytes=(world - 1) * spec.nbytes, recv_bytes=(world - 1) * spec.nbytes)
    if timer is not None:
        timer.count_call(kind)
    offsets = [owner * chunk_numel for owner in range(world)]

    def decode() -> None:
        with _timed(timer, kind, "decode", device):
            decode_payloads(gathered, spec, output.view(-1), offsets, decode_seeds)

    if async_op:
        collective = _all_gather_single()
        return DecodeOnWait(collective(gathered, blob, group=group, async_op=True), decode, collective.__name__, keep_alive=(blob,))
    with _timed(timer, kind, "transport", device):
        _all_gather_single()(gathered, blob, group=group)
    decode()
    return None


def quantized_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    layout: PayloadLayout,
    seeds: list[int],
    meter: WireMeter,
    kind: str,
    divide_factor: float = 1.0,
    *,
    source_seeds: Sequence[int] | None = None,
    error: torch.Tensor | None = None,
    async_op: bool = False,
    buffers: BufferPool | None = None,
    timer: PhaseTimer | None = None,
) -> DecodeOnWait | None:
    """Reduce-scatter by all-to-all of quantized chunks and an fp32 sum (divided by ``divide_factor``).

    ``input`` holds ``P`` rank-ordered chunks; chunk ``j`` is encoded with ``seeds[j]`` and sent to
    rank ``j``: one fused encode call for every destination. The own chunk never leaves the rank;
    one fused call adds the received chunks to it in fp32 and writes ``output`` (rounded once to its
    dtype). With the default ``divide_factor=1`` this is a SUM; FSDP2 does its averaging
    afterwards. With ``async_op`` the returned work finishes the transport and the sum on
    ``wait()``. Bytes recorded: ``(P-1) * layout.nbytes`` each way (a zero-length split for self
    keeps it off the wire).

    A rotated codec (``WireCodec.rotation``) needs ``source_seeds``: per source rank ``s``, the seed
    ``s`` encoded this rank's chunk with (entry ``rank`` is not read).

    Error feedback (``docs/qsdp.md``, "Error feedback"): ``error`` holds, for the ``P-1`` chunks
    this rank sends (the other ranks' chunks in rank order, ``(P-1) * S`` elements, fp32 or bf16),
    what the previous call's quantization left out. Each sent chunk is then ``Q(g_j + e_j)`` and
    ``error`` becomes ``(g_j + e_j) - decode(Q(g_j + e_j))``, the sum taken in fp32 and the new error
    rounded once to ``error``'s dtype. The own chunk is exact and keeps no error.
    """
    world, rank = group.size(), group.rank()
    chunk_numel = output.numel()
    if input.numel() != world * chunk_numel or len(seeds) != world:
        raise ValueError(
            f"quantized_reduce_scatter (rank {rank}/{world}): input has {input.numel()} elements and "
            f"{len(seeds)} seeds, expected {world * chunk_numel} and {world}"
        )
    if error is not None and (error.numel() != (world - 1) * chunk_numel or error.dtype not in (torch.float32, torch.bfloat16)):
        raise ValueError(
            f"quantized_reduce_scatter (rank {rank}/{world}): error has {error.numel()} elements of {error.dtype}, expected "
            f"{(world - 1) * chunk_numel} ((P-1) x output) of float32 or bfloat16"
        )
    spec, device = layout.spec, input.device
    sum_seeds = _rotation_seeds("quantized_reduce_scatter", spec, source_seeds, "source_seeds", world, rank, 0 if source_seeds is None else source_seeds[rank])
    if sum_seeds is not None:
        sum_seeds = torch.cat([sum_seeds[:rank], sum_seeds[rank + 1 :]])  # the received payloads, in source order
    flat_input = input.reshape(-1)
    others = [j for j in range(world) if j != rank]
    send = _staging(buffers, len(others) * spec.nbytes, device)
    send_seeds = _seed_table([seeds[j] for j in others], len(spec.segments))
    with _timed(timer, kind, "encode", device):
        if error is None:
            encode_payloads(flat_input, spec, [j * chunk_numel for j in others], send_seeds, send)
        else:
            _encode_with_error_feedback(flat_input.view(world, chunk_numel), others, spec, send_seeds, send, error)
    recv = _staging(buffers, send.numel(), device)
    splits = [0 if j == rank else spec.nbytes for j in range(world)]
    meter.record(kind, sent_bytes=send.numel(), recv_bytes=recv.numel())
    if timer is not None:
        timer.count_call(kind)
    own = flat_input[rank * chunk_numel : (rank + 1) * chunk_numel]
    flat_out = output.view(-1)

    def reduce() -> None:
        with _timed(timer, kind, "decode", device):
            if divide_factor == 1:
                sum_payloads(recv, spec, own, flat_out, sum_seeds)
            else:
                # Divide the fp32 sum before rounding to the output dtype (AVG): a rare path.
                total = torch.empty(chunk_numel, dtype=torch.float32, device=device)
                sum_payloads(recv, spec, own, total, sum_seeds)
                flat_out.copy_(total.div_(divide_factor))

    if async_op:
        work = dist.all_to_all_single(recv, send, output_split_sizes=splits, input_split_sizes=splits, group=group, async_op=True)
        return DecodeOnWait(work, reduce, "all_to_all_single", keep_alive=(send, input))
    with _timed(timer, kind, "transport", device):
        dist.all_to_all_single(recv, send, output_split_sizes=splits, input_split_sizes=splits, group=group)
    reduce()
    return None


def _encode_with_error_feedback(
    chunks: torch.Tensor, others: list[int], spec: PayloadSpec, seeds: torch.Tensor, send: torch.Tensor, error: torch.Tensor
) -> None:
    """Encode ``chunks[others] + error`` into ``send`` and leave in ``error`` what the codec dropped."""
    corrected = chunks[others].to(torch.float32)  # (P-1, S): a fresh fp32 copy (advanced indexing)
    corrected.add_(error.view(len(others), -1))
    sent = corrected.to(chunks.dtype).view(-1)  # what the codec reads: the gradient's own dtype
    offsets = [k * spec.numel for k in range(len(others))]
    encode_payloads(sent, spec, offsets, seeds, send)
    decoded = torch.empty(sent.numel(), dtype=torch.float32, device=sent.device)
    decode_payloads(send, spec, decoded, offsets, seeds if spec.rotated else None)
    error.view(-1).copy_(corrected.view(-1).sub_(decoded))


def counted_all_gather(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, meter: WireMeter, kind: str, async_op: bool = False
) -> dist.Work | None:
    """Plain ``all_gather_into_tensor`` (what FSDP2 issues) that records ``(P-1)*S*itemsize`` each way."""
    nbytes = (group.size() - 1) * input.numel() * input.element_size()
    meter.record(kind, sent_bytes=nbytes, recv_bytes=nbytes)
    # The same call FSDP2's DefaultAllGather makes, so the pass-through is bit-identical to stock.
    collective = _all_gather_single()
    work = collective(output, input, group=group, async_op=async_op)
    return DecodeOnWait(work, None, collective.__name__, keep_alive=(output, input)) if async_op else work


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
    collective = _reduce_scatter_single()
    work = collective(output, input, op=op, group=group, async_op=async_op)
    return DecodeOnWait(work, None, collective.__name__, keep_alive=(output, input)) if async_op else work


def alltoall_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    meter: WireMeter,
    kind: str,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    *,
    async_op: bool = False,
) -> DecodeOnWait | None:
    """An exact reduce-scatter as one ``all_to_all_single`` plus a local fp32 sum: a true reduce-scatter.

    Why: gloo's ``reduce_scatter`` all-reduces the whole buffer (pytorch/pytorch#118911), moving
    ``2 (P-1)/P`` of it each way where a reduce-scatter needs ``(P-1)/P``. This sends rank ``j`` its
    chunk of ``input`` (``P`` rank-ordered chunks of ``output.numel()`` elements; the own chunk stays
    local, a zero-length split), then sums the ``P`` chunks of this rank's slot in ascending source-rank
    order in fp32 (the same on every rank whatever the arrival order) and rounds once to ``output``'s
    dtype. ``ReduceOp.AVG`` divides the fp32 sum by ``P`` before rounding; other ops are refused
    (ValueError) before anything is sent. With ``async_op`` the returned work finishes the transport
    and the sum on ``wait()``. Bytes recorded: ``(P-1) * S * itemsize`` each way.
    """
    world, rank = group.size(), group.rank()
    chunk_numel = output.numel()
    if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        raise ValueError(f"alltoall_reduce_scatter (rank {rank}/{world}): reduce op {op} is not supported; use ReduceOp.SUM or ReduceOp.AVG")
    if input.numel() != world * chunk_numel or input.dtype != output.dtype:
        raise ValueError(
            f"alltoall_reduce_scatter (rank {rank}/{world}): input has {input.numel()} elements of {input.dtype}, "
            f"expected {world * chunk_numel} (P x output) of the output's {output.dtype}"
        )
    chunks = input.reshape(world, chunk_numel)
    send = torch.cat([chunks[:rank], chunks[rank + 1 :]]).reshape(-1)  # the other ranks' chunks, in rank order
    recv = torch.empty_like(send)
    splits = [0 if j == rank else chunk_numel for j in range(world)]
    nbytes = send.numel() * send.element_size()
    meter.record(kind, sent_bytes=nbytes, recv_bytes=nbytes)
    received = recv.view(world - 1, chunk_numel)

    def reduce() -> None:
        total = (chunks[rank] if rank == 0 else received[0]).to(torch.float32, copy=True)
        for source in range(1, world):
            total.add_(chunks[rank] if source == rank else received[source if source < rank else source - 1])
        if op == dist.ReduceOp.AVG:
            total.div_(world)
        output.view(-1).copy_(total)

    if async_op:
        work = dist.all_to_all_single(recv, send, output_split_sizes=splits, input_split_sizes=splits, group=group, async_op=True)
        return DecodeOnWait(work, reduce, "all_to_all_single", keep_alive=(send,))
    dist.all_to_all_single(recv, send, output_split_sizes=splits, input_split_sizes=splits, group=group)
    reduce()
    return None
