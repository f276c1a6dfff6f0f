"""1-bit error-feedback all-reduce (1-bit Adam / 0/1 Adam), one implementation for every process group.

Protocol (``docs/zero_one_adam.md``, "Wire format of the 1-bit all-reduce"; DeepSpeed ``runtime/comm/nccl.py``), per tensor
of ``M`` elements zero-padded to ``M'`` (a multiple of ``8N``) on ``N`` ranks:

1. worker: ``x = pad(input) + worker_error``; ``s_w = ||x|| / sqrt(M')``; bits ``b = [x >= 0]``;
   ``worker_error = x - s_w * (2b - 1)``.
2. phase 1: chunk ``j`` of the packed bits (elements ``[j M'/N, (j+1) M'/N)``) goes to rank ``j``,
   together with ``s_w`` (one all-to-all).
3. server (rank ``r`` owns chunk ``r``): ``y = sum_i (2b_i - 1) * (s_w_i / N) + server_error``;
   ``s_s = ||y|| / sqrt(M'/N)``; ``server_error = y - s_s * (2[y >= 0] - 1)``.
4. phase 2: every rank gathers every server's bits and scale (one all-gather) and decodes chunk ``j`` as
   ``s_s_j * (2b - 1)``. All ranks decode the same bytes, so the result is bit-identical everywhere.

Two deliberate transport differences from DeepSpeed, with identical numerics and identical bytes:

- The scales travel in the same collective as the bits (DeepSpeed issues a separate all-gather for them),
  so one call is **2 collectives**, not 4. Bytes per rank and direction stay
  ``2 (N-1) (M'/(8N) + 4)`` per tensor, the figure in ``docs/zero_one_adam.md``.
- Several tensors can share one call (``compressed_allreduce`` takes a list): each keeps its own padding,
  scales and error buffers (DeepSpeed's per-tensor fp32 numerics), but a whole optimizer step costs one
  all-to-all and one all-gather instead of four collectives per tensor.

The codec maths is :func:`qaccel.quant.onebit_encode` (step 1) and :func:`qaccel.quant.onebit_server`
(step 3), fused error-feedback ops bit-identical to the ``sign_compress`` / ``sign_decompress`` sequence
they replace, and :func:`qaccel.quant.sign_decompress` (step 4); this module only lays out, moves and
records bytes. :func:`onebit_layout` is the single place that decides padding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .._torch_internals import all_gather_single
from ..quant import SignCompressed, onebit_encode, onebit_server, sign_decompress
from ._accounting import WireMeter, default_meter

__all__ = [
    "ONEBIT_PADDINGS",
    "OneBitLayout",
    "OneBitWireBytes",
    "onebit_layout",
    "onebit_wire_bytes",
    "compressed_allreduce",
    "start_compressed_allreduce",
    "PendingCompressedAllReduce",
]

ONEBIT_PADDINGS = ("deepspeed", "minimal")
"""``deepspeed``: pad to a multiple of ``N * lcm(N, 8)`` (DeepSpeed's optimizers; the scale depends on
``sqrt(M')``, so this is needed for numeric parity). ``minimal``: pad to a multiple of ``8N`` (whole bytes
per server chunk, the real requirement of the protocol)."""

_SCALE_BYTES = 4  # one fp32 scale per tensor per rank


@dataclass(frozen=True)
class OneBitLayout:
    """Padding of one tensor for the 1-bit all-reduce.

    Attributes:
        numel: real elements ``M``.
        world_size: ranks ``N`` of the process group.
        padded_numel: ``M'``, a multiple of ``8N`` (0 when ``M == 0``); fixed for the life of the
            error buffers.
    """

    numel: int
    world_size: int
    padded_numel: int

    @property
    def server_numel(self) -> int:
        """Elements of the chunk each rank reduces (``M'/N``), also the server error buffer length."""
        return self.padded_numel // self.world_size

    @property
    def chunk_sign_bytes(self) -> int:
        """Packed sign bytes of one chunk (``M'/(8N)``)."""
        return self.server_numel // 8

    def new_error_buffers(self, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed fp32 ``(worker_error, server_error)`` of lengths ``M'`` and ``M'/N``."""
        worker = torch.zeros(self.padded_numel, dtype=torch.float32, device=device)
        server = torch.zeros(self.server_numel, dtype=torch.float32, device=device)
        return worker, server


@dataclass(frozen=True)
class OneBitWireBytes:
    """Bytes one rank sends and receives in one :func:`compressed_allreduce` call, and its collectives."""

    sent_bytes: int
    recv_bytes: int
    collectives: int


def onebit_layout(numel: int, world_size: int, padding: str = "deepspeed") -> OneBitLayout:
    """Decide ``M'`` for a tensor of ``numel`` elements on ``world_size`` ranks.

    Args:
        numel: elements of the tensor (>= 0).
        world_size: ranks of the process group (>= 1).
        padding: one of :data:`ONEBIT_PADDINGS`.

    Returns:
        The layout; ``padded_numel`` is ``numel`` rounded up to the padding multiple.

    Raises:
        ValueError: for a negative ``numel``, ``world_size < 1`` or an unknown ``padding``.
    """
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"onebit_layout: numel={numel!r}: must be an int >= 0")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"onebit_layout: world_size={world_size!r}: must be an int >= 1")
    if padding == "deepspeed":
        # DeepSpeed: divider = 8N / gcd(N, 8) = lcm(N, 8); tensors padded to a multiple of N * divider.
        multiple = world_size * (8 * world_size // math.gcd(world_size, 8))
    elif padding == "minimal":
        multiple = 8 * world_size
    else:
        raise ValueError(f"onebit_layout: padding={padding!r}: must be one of {', '.join(ONEBIT_PADDINGS)}")
    return OneBitLayout(numel=numel, world_size=world_size, padded_numel=math.ceil(numel / multiple) * multiple)


def onebit_wire_bytes(layouts: Sequence[OneBitLayout]) -> OneBitWireBytes:
    """Exact bytes of one :func:`compressed_allreduce` call over ``layouts`` (what it records).

    Each rank sends ``N-1`` rows in the all-to-all and its row to ``N-1`` peers in the all-gather (ring
    figure); a row holds one fp32 scale per non-empty tensor plus ``M'/(8N)`` sign bytes per tensor. Per
    tensor this is ``docs/zero_one_adam.md``'s ``2 (N-1) M'/(8N) + 2 (N-1) 4`` in each direction.
    """
    live = [layout for layout in layouts if layout.numel > 0]
    if not live:
        return OneBitWireBytes(0, 0, 0)
    world_size = live[0].world_size
    if world_size == 1:
        return OneBitWireBytes(0, 0, 0)
    row_bytes = _SCALE_BYTES * len(live) + sum(layout.chunk_sign_bytes for layout in live)
    per_phase = (world_size - 1) * row_bytes
    return OneBitWireBytes(2 * per_phase, 2 * per_phase, 2)


def _group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("compressed_allreduce: a process group was given but torch.distributed is not initialized")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _check_inputs(
    tensors: Sequence[torch.Tensor],
    worker_errors: Sequence[torch.Tensor],
    server_errors: Sequence[torch.Tensor],
    layouts: Sequence[OneBitLayout],
    rank: int,
    world_size: int,
) -> None:
    where = f"compressed_allreduce (rank {rank}/{world_size})"
    if not (len(tensors) == len(worker_errors) == len(server_errors) == len(layouts)):
        raise ValueError(
            f"{where}: got {len(tensors)} tensors, {len(worker_errors)} worker errors, "
            f"{len(server_errors)} server errors and {len(layouts)} layouts; all must match"
        )
    for k, (x, worker, server, layout) in enumerate(zip(tensors, worker_errors, server_errors, layouts, strict=True)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"{where}: tensors[{k}] must be a floating-point torch.Tensor")
        if layout.world_size != world_size:
            raise ValueError(f"{where}: layouts[{k}].world_size={layout.world_size} != group size {world_size}")
        if x.numel() != layout.numel:
            raise ValueError(f"{where}: tensors[{k}].numel()={x.numel()} != layouts[{k}].numel={layout.numel}")
        for name, buf, length in (("worker_errors", worker, layout.padded_numel), ("server_errors", server, layout.server_numel)):
            if buf.dtype != torch.float32 or buf.dim() != 1 or buf.numel() != length or not buf.is_contiguous():
                raise ValueError(
                    f"{where}: {name}[{k}] must be a contiguous 1-D float32 tensor of {length} elements, "
                    f"got {buf.dtype} {tuple(buf.shape)}"
                )
            if buf.device != x.device:
                raise ValueError(f"{where}: {name}[{k}] is on {buf.device}, tensors[{k}] on {x.device}")


def compressed_allreduce(
    tensors: Sequence[torch.Tensor],
    worker_errors: Sequence[torch.Tensor],
    server_errors: Sequence[torch.Tensor],
    layouts: Sequence[OneBitLayout],
    *,
    group: dist.ProcessGroup | None = None,
    meter: WireMeter | None = None,
    kind_prefix: str = "onebit",
) -> list[torch.Tensor]:
    """Average ``tensors`` over the ranks of ``group`` with 1-bit compression and two-sided error feedback.

    Every rank calls this with tensors of the same layouts. The error buffers are updated in place and
    must persist between calls (they carry the compression error into the next call).

    Args:
        tensors: the local values (any float dtype and shape; read as fp32).
        worker_errors: per tensor, fp32 ``(M',)`` worker error buffer.
        server_errors: per tensor, fp32 ``(M'/N,)`` server error buffer of this rank's chunk.
        layouts: per tensor, from :func:`onebit_layout` with the group's world size.
        group: process group (default: the default group; world size 1 when torch.distributed is not
            initialized).
        meter: wire meter to record into (default :data:`qaccel.comm.default_meter`).
        kind_prefix: the meter records ``<prefix>.all_to_all`` and ``<prefix>.all_gather`` (the sharded
            optimizers use ``hsdp.onebit``: their group spans nodes).

    Returns:
        Per tensor, a new fp32 tensor of the input's shape holding the decoded average; bit-identical on
        every rank. An empty tensor returns an empty result, has its (empty) buffers untouched and adds
        nothing to the wire.

    Raises:
        ValueError / TypeError: on inconsistent inputs, before any communication.
    """
    return start_compressed_allreduce(
        tensors, worker_errors, server_errors, layouts, group=group, meter=meter, kind_prefix=kind_prefix
    ).finish()


def start_compressed_allreduce(
    tensors: Sequence[torch.Tensor],
    worker_errors: Sequence[torch.Tensor],
    server_errors: Sequence[torch.Tensor],
    layouts: Sequence[OneBitLayout],
    *,
    group: dist.ProcessGroup | None = None,
    meter: WireMeter | None = None,
    kind_prefix: str = "onebit",
) -> PendingCompressedAllReduce:
    """The worker side of :func:`compressed_allreduce` (step 1), now; the rest when ``finish()`` is called.

    Reads ``tensors`` and updates ``worker_errors`` before it returns, so the caller may change the
    tensors afterwards; ``finish()`` runs phases 1 and 2 (the collectives, the server side, decoding)
    and returns what :func:`compressed_allreduce` returns. The optimizers' overlapped step starts a
    DDP bucket's call in the communication hook and finishes it on a communication thread.
    Same arguments and errors as :func:`compressed_allreduce`.
    """
    rank, world_size = _group_rank_and_size(group)
    _check_inputs(tensors, worker_errors, server_errors, layouts, rank, world_size)
    meter = default_meter if meter is None else meter
    outputs = [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in tensors]
    live = [k for k, layout in enumerate(layouts) if layout.numel > 0]
    if not live:
        return PendingCompressedAllReduce(outputs, [], [], [], None, group, world_size, meter, kind_prefix, 0)
    device = tensors[live[0]].device
    num_live = len(live)
    scale_bytes = _SCALE_BYTES * num_live
    offsets, row_bytes = [], scale_bytes
    for k in live:
        offsets.append(row_bytes)
        row_bytes += layouts[k].chunk_sign_bytes

    # Worker side: compensate, compress, keep the error.
    send = torch.empty((world_size, row_bytes), dtype=torch.uint8, device=device)  # row j goes to rank j
    worker_scales = torch.empty(num_live, dtype=torch.float32, device=device)
    for slot, (k, offset) in enumerate(zip(live, offsets, strict=True)):
        layout = layouts[k]
        signs, scales = onebit_encode(tensors[k], worker_errors[k])  # one scale: s_w of the whole tensor
        send[:, offset : offset + layout.chunk_sign_bytes] = signs.view(world_size, layout.chunk_sign_bytes)
        worker_scales[slot] = scales[0]
    send[:, :scale_bytes] = worker_scales.view(torch.uint8)
    live_layouts = [layouts[k] for k in live]
    live_server_errors = [server_errors[k] for k in live]
    live_outputs = [outputs[k] for k in live]
    return PendingCompressedAllReduce(
        outputs, live_outputs, live_layouts, live_server_errors, send, group, world_size, meter, kind_prefix, scale_bytes,
        offsets,
    )  # fmt: skip


@dataclass
class PendingCompressedAllReduce:
    """A :func:`compressed_allreduce` call whose worker side is done (:func:`start_compressed_allreduce`)."""

    outputs: list[torch.Tensor]
    live_outputs: list[torch.Tensor]
    live_layouts: list[OneBitLayout]
    live_server_errors: list[torch.Tensor]
    send: torch.Tensor | None  # (world, row bytes): the scales, then each live tensor's sign chunk
    group: dist.ProcessGroup | None
    world_size: int
    meter: WireMeter
    kind_prefix: str
    scale_bytes: int
    offsets: list[int] = field(default_factory=list)  # where each live tensor's signs start in a row

    def finish(self) -> list[torch.Tensor]:
        """Phases 1 and 2: exchange, reduce on the server side, gather and decode; returns the averages."""
        if self.send is None:
            return self.outputs
        world_size, scale_bytes, row_bytes = self.world_size, self.scale_bytes, self.send.shape[1]
        device = self.send.device
        num_live = len(self.live_layouts)
        slots = list(zip(self.live_layouts, self.live_server_errors, self.offsets, strict=True))

        # Phase 1: rank j receives chunk j of every worker, with every worker's scales.
        recv = _all_to_all(self.send, self.group, world_size, self.meter, f"{self.kind_prefix}.all_to_all")
        self.send = None  # finish() runs once
        received_scales = _scales(recv, scale_bytes)  # (world, num_live)

        # Server side: average the decoded chunks, compensate, compress again.
        server_row = torch.empty(row_bytes, dtype=torch.uint8, device=device)
        server_scales = torch.empty(num_live, dtype=torch.float32, device=device)
        for slot, (layout, server_error, offset) in enumerate(slots):
            chunk_bytes = layout.chunk_sign_bytes
            # decodes with (s_w / N) * (+-1) (DeepSpeed's order), sums over ranks, adds the server error
            signs, scales = onebit_server(recv[:, offset : offset + chunk_bytes], received_scales[:, slot], server_error)
            server_row[offset : offset + chunk_bytes] = signs
            server_scales[slot] = scales[0]
        server_row[:scale_bytes] = server_scales.view(torch.uint8)

        # Phase 2: everyone gathers every server chunk and decodes the same bytes.
        gathered = _all_gather(server_row, self.group, world_size, self.meter, f"{self.kind_prefix}.all_gather")  # (world, row_bytes)
        gathered_scales = _scales(gathered, scale_bytes)  # (world, num_live)
        for slot, ((layout, _, offset), output) in enumerate(zip(slots, self.live_outputs, strict=True)):
            server_chunks = SignCompressed(
                signs=gathered[:, offset : offset + layout.chunk_sign_bytes].contiguous().view(-1),
                scales=gathered_scales[:, slot].contiguous(),
                numel=layout.padded_numel,
                chunks=world_size,
                shape=torch.Size((layout.padded_numel,)),
            )
            decoded = sign_decompress(server_chunks)
            output.view(-1).copy_(decoded[: layout.numel])
        return self.outputs


def _scales(rows: torch.Tensor, scale_bytes: int) -> torch.Tensor:
    """The fp32 scales at the start of each row, as a new ``(rows, scales)`` tensor.

    A copy, not ``.contiguous().view``: with one row the slice already counts as contiguous and keeps
    the row's stride, which a byte-to-float view refuses.
    """
    scales = torch.empty((rows.shape[0], scale_bytes // _SCALE_BYTES), dtype=torch.float32, device=rows.device)
    scales.view(torch.uint8).copy_(rows[:, :scale_bytes])
    return scales


def _all_to_all(send: torch.Tensor, group: dist.ProcessGroup | None, world_size: int, meter: WireMeter, kind: str) -> torch.Tensor:
    if world_size == 1:  # nothing leaves the rank: no call, no bytes
        return send
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    row_bytes = send.shape[1]
    meter.record(kind, sent_bytes=(world_size - 1) * row_bytes, recv_bytes=(world_size - 1) * row_bytes)
    return recv


def _all_gather(row: torch.Tensor, group: dist.ProcessGroup | None, world_size: int, meter: WireMeter, kind: str) -> torch.Tensor:
    if world_size == 1:
        return row.view(1, -1)
    gathered = torch.empty(world_size * row.numel(), dtype=row.dtype, device=row.device)  # gloo wants it flat
    all_gather_single(gathered, row, group)
    meter.record(kind, sent_bytes=(world_size - 1) * row.numel(), recv_bytes=(world_size - 1) * row.numel())
    return gathered.view(world_size, row.numel())
