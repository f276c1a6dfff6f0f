"""``QuantizedAllGather`` / ``QuantizedReduceScatter``: FSDP2 comms that put QSDP codes on the wire.

FSDP2 calls these with its flat, padded, rank-ordered buffers (``docs/qsdp.md``, "What FSDP2
hands a comm").
With a codec they run the quantized collectives of :mod:`qaccel.comm`; without one (bits off,
or a unit too small to be worth it) they issue exactly FSDP2's default collective and only count
its bytes, so the hook path itself changes nothing. On CPU the reduce-scatter of either kind may
return with its transport running and be finished before backward ends
(:mod:`qaccel.fsdp._rs_overlap`), with bit-identical gradients.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._torch_internals import fsdp2_comm_bases
from ..comm import (
    BufferPool,
    PayloadLayout,
    PhaseTimer,
    WireCodec,
    WireMeter,
    counted_all_gather,
    counted_reduce_scatter,
    quantized_all_gather,
    quantized_reduce_scatter,
)
from ._rs_overlap import FSDPTail, ReduceScatterOverlap
from ._seeds import SeedSchedule

__all__ = ["UnitPlan", "QuantizedAllGather", "QuantizedReduceScatter", "KIND_QSDP_AG", "KIND_QSDP_RS", "KIND_FSDP_AG", "KIND_FSDP_RS"]

logger = logging.getLogger(__name__)

# FSDP2's private comm base classes (torch >= 2.9); a torch without them stops here with the checked versions.
AllGather, ReduceScatter = fsdp2_comm_bases()

KIND_QSDP_AG = "qsdp.all_gather"
KIND_QSDP_RS = "qsdp.reduce_scatter"
KIND_FSDP_AG = "fsdp.all_gather"  # stock collective (bits off or unit below unit_min_numel)
KIND_FSDP_RS = "fsdp.reduce_scatter"


@dataclass
class UnitPlan:
    """What one unit sends: its segment map and whether it is quantized at all.

    Attributes:
        index: unit index (part of every seed).
        name: for messages.
        segments: ``(padded_shard_numel, quantize)`` per parameter, in buffer order.
        enabled: False when the unit stays on the stock collectives (``unit_min_numel``, or no
            parameter worth quantizing).
    """

    index: int
    name: str
    segments: tuple[tuple[int, bool], ...]
    enabled: bool

    def __post_init__(self) -> None:
        self._layouts: dict[tuple, PayloadLayout] = {}

    @classmethod
    def build(cls, index: int, name: str, shapes: Sequence[torch.Size], shard_numels: Sequence[int], *, param_min_numel: int, unit_min_numel: int) -> UnitPlan:
        """Segment map: 1-D or small parameters raw, others quantized; adjacent raw ones merged."""
        segments: list[tuple[int, bool]] = []
        for shape, numel in zip(shapes, shard_numels, strict=True):
            quantize = len(shape) >= 2 and shape.numel() >= max(param_min_numel, 1)
            if numel == 0:
                continue
            if segments and not quantize and not segments[-1][1]:
                segments[-1] = (segments[-1][0] + numel, False)
            else:
                segments.append((numel, quantize))
        total = sum(n for n, _ in segments)
        enabled = total >= unit_min_numel and any(q for _, q in segments)
        return cls(index=index, name=name, segments=tuple(segments), enabled=enabled)

    def layout(self, codec: WireCodec, chunk_numel: int, elem_dtype: torch.dtype) -> PayloadLayout:
        """The payload layout for a chunk of ``chunk_numel`` elements, cached per (length, dtype)."""
        key = (codec, chunk_numel, elem_dtype)
        layout = self._layouts.get(key)
        if layout is None:
            segments = self.segments
            if sum(n for n, _ in segments) != chunk_numel:
                # The buffer does not match our reading of FSDP's layout (e.g. a torch change):
                # stay correct with uniform buckets over the whole chunk, and say so once.
                logger.warning(
                    "QSDP unit %d (%s): segment map sums to %d elements but the FSDP buffer chunk has %d; "
                    "falling back to uniform buckets over the whole chunk",
                    self.index, self.name, sum(n for n, _ in segments), chunk_numel,
                )
                segments = ((chunk_numel, True),)
            layout = PayloadLayout(segments=segments, codec=codec, elem_dtype=elem_dtype)
            self._layouts[key] = layout
        return layout


class _UnitComm:
    """What both QSDP comms hold, and FSDP2's comm buffers from a pool that lives across steps.

    FSDP2 allocates its flat all-gather output and reduce-scatter input through ``allocate``; on
    CPU they come from the model's :class:`qaccel.comm.BufferPool` (so are our encoded blobs), which
    hands a buffer out again once nothing refers to it. The reduce-scatter *output* is always
    fresh: FSDP2 may keep it as the sharded gradient itself.
    """

    def __init__(
        self,
        plan: UnitPlan,
        codec: WireCodec | None,
        seeds: SeedSchedule,
        meter: WireMeter,
        buffers: BufferPool | None = None,
    ) -> None:
        self.plan = plan
        self.codec = codec if plan.enabled else None
        self.seeds = seeds
        self.meter = meter
        self.buffers = buffers
        self.timer: PhaseTimer | None = None  # set by benchmarks to split collectives into phases
        # Hierarchical QSDP: replica index * shard size, so gradient seeds name the rank among all
        # ranks and the replicas of a shard draw independent noise (0 on a 1-D mesh).
        self.owner_offset = 0
        # QSDPConfig.overlap_reduce_scatter: the model's pending reduce-scatters (set by the installer).
        self.overlap: ReduceScatterOverlap | None = None

    def _poolable(self, numel: int) -> bool:
        return True

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device, pooled: bool = False) -> torch.Tensor:
        numel = math.prod(size)
        if self.buffers is None or not (pooled or self._poolable(numel)):
            return torch.empty(*size, dtype=dtype, device=device)
        return self.buffers.get(numel, dtype, device).view(*size)


class QuantizedAllGather(_UnitComm, AllGather):
    """FSDP2 ``AllGather`` that gathers this rank's shard as k-bit codes plus bucket metadata.

    Every rank, the owner included, decodes every chunk from the gathered bytes, so all ranks
    compute with bit-identical unsharded weights. Forward and backward re-gathers of one step use
    the same seed and therefore decode the same weights.

    Args:
        plan: the unit's segment map.
        codec: the weight quantizer, or ``None`` for the stock collective (bytes still counted).
        seeds: the model's seed schedule.
        meter: where bytes are recorded (kinds ``qsdp.all_gather`` / ``fsdp.all_gather``).
    """

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
        if self.overlap is not None:
            # The first collective after a backward that raised: settle its pending reduce-scatters.
            self.overlap.drop_stale()
        if self.codec is None:
            return counted_all_gather(output_tensor, input_tensor, group, self.meter, KIND_FSDP_AG, async_op=async_op)
        layout = self.plan.layout(self.codec, input_tensor.numel(), input_tensor.dtype)
        seed = self.seeds.weight_seed(self.plan.index, group.rank())
        # A rotated codec decodes every owner's chunk with that owner's signs, hence its seed.
        owner_seeds = [self.seeds.weight_seed(self.plan.index, owner) for owner in range(group.size())] if layout.spec.rotated else None
        # With async_op (FSDP2 prefetching, see apply_prefetch) the work decodes when FSDP2 waits on it.
        return quantized_all_gather(
            output_tensor, input_tensor, group, layout, seed, self.meter, KIND_QSDP_AG,
            owner_seeds=owner_seeds, async_op=async_op, buffers=self.buffers, timer=self.timer,
        )  # fmt: skip


class QuantizedReduceScatter(_UnitComm, ReduceScatter):
    """FSDP2 ``ReduceScatter`` as an all-to-all of k-bit chunks, summed in fp32: a SUM transport.

    The installer forces ``ReduceOp.SUM`` on the unit (``set_force_sum_reduction_for_comms``) and
    leaves the divide factor alone, so FSDP2 itself divides the summed shard afterwards, by the
    data-parallel size or by a factor the user set with ``set_gradient_divide_factor`` (before or
    after the install), in ``reduce_dtype``. ``ReduceOp.AVG`` (what FSDP2 passes if forced SUM
    was switched off again and no factor is set) is honoured too: the fp32 sum is divided by the
    group size. ``PREMUL_SUM`` and other ops are refused, because the comm cannot read their
    scale back; gloo's AVG (pytorch/pytorch#162338) is never used.

    Each call of a unit within one optimizer step draws fresh gradient noise (see
    :class:`qaccel.fsdp.SeedSchedule`), so micro-batches that each reduce-scatter do not repeat it.

    Error feedback (``QSDPConfig.grad_error_feedback``, ``error_dtype``): the unit keeps, per rank,
    what quantization left out of the chunks it sent (``error``, ``(P-1) x`` the output's
    elements), allocated zero on the first call and carried from call to call, micro-batches
    included; ``error`` is saved as it is and :meth:`load_error_state` restores it.

    Overlap (``QSDPConfig.overlap_reduce_scatter``, set by the installer as ``overlap``): on CPU a
    call whose output FSDP2 only divides, casts and turns into gradients starts its transport and
    returns with ``-0.0`` in the output; :class:`qaccel.fsdp._rs_overlap.ReduceScatterOverlap`
    finishes it before backward ends. Seeds and error feedback advance at the call, as without it.

    Args:
        plan: the unit's segment map.
        codec: the gradient quantizer, or ``None`` for the stock collective with FSDP's own op.
        seeds: the model's seed schedule.
        meter: where bytes are recorded (kinds ``qsdp.reduce_scatter`` / ``fsdp.reduce_scatter``).
        buffers: the model's buffer pool.
        error_dtype: the error-feedback store (float32 or bfloat16), or ``None`` for none.
    """

    def __init__(
        self,
        plan: UnitPlan,
        codec: WireCodec | None,
        seeds: SeedSchedule,
        meter: WireMeter,
        buffers: BufferPool | None = None,
        error_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(plan, codec, seeds, meter, buffers)
        self.error_dtype = error_dtype if self.codec is not None else None
        self.error: torch.Tensor | None = None
        # The unit's FSDPParamGroup, whose use of the output an overlapped call replays (set by the installer).
        self.param_group: Any = None

    def load_error_state(self, error: torch.Tensor | None) -> None:
        """Restore a saved buffer (``None``: start from zero), cast to this unit's store dtype."""
        if error is not None and self.error_dtype is None:
            raise ValueError(f"QSDP unit {self.plan.name}: a saved error-feedback buffer, but error feedback is off")
        self.error = None if error is None else error.to(self.error_dtype).clone()

    def _poolable(self, numel: int) -> bool:
        # FSDP2 allocates the input (P*S elements) and then the output (S): only the input is pooled.
        return numel >= 2 * sum(n for n, _ in self.plan.segments)

    @property
    def needs_forced_sum(self) -> bool:
        """True when the installer must force ``ReduceOp.SUM`` on the unit (quantized gradients)."""
        return self.codec is not None

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None:
        if self.overlap is not None and not async_op and output_tensor.device.type == "cpu":
            # On CPU FSDP2 calls this synchronously; overlap the transport with the rest of backward
            # where FSDP2's use of the output can be replayed exactly (qaccel.fsdp._rs_overlap).
            tail = self.overlap.plan(self.param_group, group, output_tensor, op)
            if isinstance(tail, FSDPTail):
                reduced = self.allocate(output_tensor.shape, dtype=output_tensor.dtype, device=output_tensor.device, pooled=True)
                start = lambda into: self._reduce_scatter(into, input_tensor, group, op, async_op=True)  # noqa: E731
                self.overlap.start(start, output_tensor, tail, reduced)
                return None
            self.overlap.fall_back(tail)
        return self._reduce_scatter(output_tensor, input_tensor, group, op, async_op)

    def _reduce_scatter(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp, async_op: bool
    ) -> dist.Work | None:
        """The collective itself: quantized all-to-all with an fp32 sum, or FSDP2's own with byte counting."""
        if self.codec is None:
            return counted_reduce_scatter(output_tensor, input_tensor, group, op, self.meter, KIND_FSDP_RS, async_op=async_op)
        world, rank = group.size(), group.rank()
        if op == dist.ReduceOp.SUM:
            divide_factor = 1.0
        elif op == dist.ReduceOp.AVG:
            divide_factor = float(world)
        else:
            raise RuntimeError(
                f"QuantizedReduceScatter (rank {rank}/{world}, unit {self.plan.name}): got reduce op {op}; QSDP sums "
                "quantized chunks and supports SUM (FSDP2 then divides by the data-parallel size or by "
                "set_gradient_divide_factor) and AVG. The installer set set_force_sum_reduction_for_comms(True) on "
                "the unit; keep it on to use a custom gradient divide factor"
            )
        layout = self.plan.layout(self.codec, output_tensor.numel(), input_tensor.dtype)
        call = self.seeds.next_grad_call(self.plan.index)
        owner = self.owner_offset + rank
        seeds = [self.seeds.grad_seed(self.plan.index, owner, dest, call) for dest in range(world)]
        # A rotated codec sums each source's chunk with that source's signs, hence its seed.
        source_seeds = (
            [self.seeds.grad_seed(self.plan.index, self.owner_offset + source, rank, call) for source in range(world)]
            if layout.spec.rotated
            else None
        )
        return quantized_reduce_scatter(
            output_tensor, input_tensor, group, layout, seeds, self.meter, KIND_QSDP_RS, divide_factor,
            source_seeds=source_seeds, error=self._error_buffer(world, output_tensor),
            async_op=async_op, buffers=self.buffers, timer=self.timer,
        )  # fmt: skip

    def _error_buffer(self, world: int, output: torch.Tensor) -> torch.Tensor | None:
        """This rank's error-feedback buffer for a call with ``output``: zero at first, kept afterwards."""
        if self.error_dtype is None:
            return None
        numel = (world - 1) * output.numel()
        if self.error is not None and self.error.numel() == numel and self.error.device != output.device:
            self.error = self.error.to(output.device)  # restored from a checkpoint, which holds it on the CPU
        if self.error is None or self.error.numel() != numel:
            if self.error is not None:
                logger.warning(
                    "QSDP unit %s: the error-feedback buffer holds %d elements but this reduce-scatter needs %d (the world "
                    "size changed): restarting it from zero",
                    self.plan.name, self.error.numel(), numel,
                )  # fmt: skip
            self.error = torch.zeros(numel, dtype=self.error_dtype, device=output.device)
        return self.error
