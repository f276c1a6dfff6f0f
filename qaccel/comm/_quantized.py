"""Quantized all-gather and all-to-all reduce-scatter over a process group, with exact byte counts.

Each rank-chunk travels as one uint8 blob laid out by :class:`qaccel.comm.PayloadLayout`
(``docs/qsdp.md``, "Wire format"), so one ``all_gather_single`` / ``all_to_all_single`` moves codes
and metadata together. The codec maths lives in :mod:`qaccel.quant`; this module only moves the
bytes and records them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist

from .._torch_internals import all_gather_single
from ..quant import PayloadSpec, decode_payloads, encode_payloads, sum_payloads
from ._accounting import WireMeter
from ._buffers import BufferPool
from ._payload import PayloadLayout, seed_table
from ._phases import PhaseTimer
from ._work import DecodeOnWait

__all__ = ["quantized_all_gather", "quantized_reduce_scatter"]


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
    return seed_table([int(value) for value in seeds], len(spec.segments))


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


def _move(
    start: Callable[[bool], dist.Work | None],
    finish: Callable[[], None],
    collective: str,
    keep_alive: tuple[torch.Tensor, ...],
    async_op: bool,
    timer: PhaseTimer | None,
    kind: str,
    device: torch.device,
) -> DecodeOnWait | None:
    """Run the transport ``start(async_op)``; then ``finish`` now, or on ``wait()`` of the returned work."""
    if async_op:
        return DecodeOnWait(start(True), finish, collective, keep_alive=keep_alive)
    with _timed(timer, kind, "transport", device):
        start(False)
    finish()
    return None


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
        encode_payloads(input.reshape(-1), spec, [0], seed_table([seed], len(spec.segments)), blob)
    gathered = _staging(buffers, world * spec.nbytes, device)
    meter.record(kind, sent_bytes=(world - 1) * spec.nbytes, recv_bytes=(world - 1) * spec.nbytes)
    if timer is not None:
        timer.count_call(kind)
    offsets = [owner * chunk_numel for owner in range(world)]

    def decode() -> None:
        with _timed(timer, kind, "decode", device):
            decode_payloads(gathered, spec, output.view(-1), offsets, decode_seeds)

    def start(is_async: bool) -> dist.Work | None:
        return all_gather_single(gathered, blob, group, async_op=is_async)

    return _move(start, decode, "all_gather_single", (blob,), async_op, timer, kind, device)


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
    _check_reduce_scatter_args(input, chunk_numel, seeds, error, world, rank)
    spec, device = layout.spec, input.device
    sum_seeds = _rotation_seeds("quantized_reduce_scatter", spec, source_seeds, "source_seeds", world, rank, 0 if source_seeds is None else source_seeds[rank])
    if sum_seeds is not None:
        sum_seeds = torch.cat([sum_seeds[:rank], sum_seeds[rank + 1 :]])  # the received payloads, in source order
    flat_input = input.reshape(-1)
    others = [j for j in range(world) if j != rank]
    send = _staging(buffers, len(others) * spec.nbytes, device)
    send_seeds = seed_table([seeds[j] for j in others], len(spec.segments))
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

    def start(is_async: bool) -> dist.Work | None:
        return dist.all_to_all_single(recv, send, output_split_sizes=splits, input_split_sizes=splits, group=group, async_op=is_async)

    return _move(start, reduce, "all_to_all_single", (send, input), async_op, timer, kind, device)


def _check_reduce_scatter_args(
    input: torch.Tensor, chunk_numel: int, seeds: Sequence[int], error: torch.Tensor | None, world: int, rank: int
) -> None:
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


