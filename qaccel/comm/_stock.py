"""Full-precision collectives that count their bytes: FSDP2's own calls, and an exact all-to-all reduce-scatter.

The stock path of a QSDP unit (bits off, or a unit too small to quantize) issues exactly the call
FSDP2's default comm issues and only records its bytes, so it stays bit-identical to stock FSDP2.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._torch_internals import all_gather_single, reduce_scatter_single
from ._accounting import WireMeter
from ._work import DecodeOnWait

__all__ = ["counted_all_gather", "counted_reduce_scatter", "alltoall_reduce_scatter"]


def counted_all_gather(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, meter: WireMeter, kind: str, async_op: bool = False
) -> dist.Work | None:
    """Plain ``all_gather_into_tensor`` (what FSDP2 issues) that records ``(P-1)*S*itemsize`` each way."""
    nbytes = (group.size() - 1) * input.numel() * input.element_size()
    meter.record(kind, sent_bytes=nbytes, recv_bytes=nbytes)
    # The same call FSDP2's DefaultAllGather makes, so the pass-through is bit-identical to stock.
    work = all_gather_single(output, input, group, async_op=async_op)
    return DecodeOnWait(work, None, "all_gather_single", keep_alive=(output, input)) if async_op else work


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
    work = reduce_scatter_single(output, input, group, op, async_op=async_op)
    return DecodeOnWait(work, None, "reduce_scatter_single", keep_alive=(output, input)) if async_op else work


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
