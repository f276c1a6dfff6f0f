"""QSDP's FSDP2 comms: transports that quantize and move a unit's bytes, and FSDP2's own collective, counted.

FSDP2 calls a comm with its flat, padded, rank-ordered buffers (``docs/qsdp.md``, "What FSDP2
hands a comm"). As FSDP2's own comms (``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``)
each one is a small object that gets everything it needs at construction, and each does one thing:

- :class:`QuantizedAllGather` / :class:`QuantizedReduceScatter`: k-bit codes on the wire, through
  the quantized collectives of :mod:`qaccel.comm`;
- :class:`CountedAllGather` / :class:`CountedReduceScatter`: exactly FSDP2's default collective,
  its bytes recorded (bits off, or a unit too small to be worth quantizing), so the hook path
  itself changes nothing.

Overlapping the reduce-scatter with backward on CPU wraps either reduce-scatter
(:class:`qaccel.fsdp._rs_overlap.OverlappedReduceScatter`); hierarchical QSDP's all-reduce across
replicas is a hook beside them (:mod:`qaccel.fsdp._replica`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.distributed as dist

from .._torch_internals import fsdp2_comm_bases
from ..comm import (
    BufferPool,
    PhaseTimer,
    WireCodec,
    WireMeter,
    counted_all_gather,
    counted_reduce_scatter,
    quantized_all_gather,
    quantized_reduce_scatter,
)
from ._plan import UnitPlan
from ._seeds import SeedSchedule

__all__ = [
    "QSDPComm",
    "QuantizedAllGather",
    "QuantizedReduceScatter",
    "CountedAllGather",
    "CountedReduceScatter",
    "UnitPlan",
    "KIND_QSDP_AG",
    "KIND_QSDP_RS",
    "KIND_FSDP_AG",
    "KIND_FSDP_RS",
]

logger = logging.getLogger(__name__)

# FSDP2's private comm base classes (torch >= 2.9); a torch without them stops here with the checked versions.
AllGather, ReduceScatter = fsdp2_comm_bases()

KIND_QSDP_AG = "qsdp.all_gather"
KIND_QSDP_RS = "qsdp.reduce_scatter"
KIND_FSDP_AG = "fsdp.all_gather"  # stock collective (bits off or unit below unit_min_numel)
KIND_FSDP_RS = "fsdp.reduce_scatter"


class QSDPComm:
    """Base of every comm QSDP installs on an FSDP2 unit: FSDP2's comm buffers from a pool that lives across steps.

    FSDP2 allocates its flat all-gather output and reduce-scatter input through ``allocate``; on
    CPU they come from the model's :class:`qaccel.comm.BufferPool` (so do the encoded blobs), which
    hands a buffer out again once nothing refers to it. Allocations smaller than
    ``pool_min_numel`` are fresh: a reduce-scatter passes ``2 x`` its output here, because FSDP2
    allocates the input (``P x S`` elements) and then the output (``S``), and may keep the output
    as the sharded gradient itself. Being a ``QSDPComm`` is also how the installer tells its own
    comms (re-installable) from another custom comm (refused).

    Args:
        buffers: the model's buffer pool (None: a pool of this comm's own).
        pool_min_numel: the smallest allocation taken from the pool.
    """

    def __init__(self, buffers: BufferPool | None = None, pool_min_numel: int = 0) -> None:
        self.buffers = BufferPool() if buffers is None else buffers
        self.pool_min_numel = pool_min_numel

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(size)
        if numel < self.pool_min_numel:
            return torch.empty(*size, dtype=dtype, device=device)
        return self.buffers.get(numel, dtype, device).view(*size)


def _require_quantized(cls: str, plan: UnitPlan, codec: WireCodec | None) -> WireCodec:
    if codec is None or not plan.enabled:
        why = "codec is None" if codec is None else "the unit's plan is not enabled (unit_min_numel, or nothing worth quantizing)"
        stock = cls.replace("Quantized", "Counted")
        raise ValueError(f"{cls} (unit {plan.name}): {why}; the unit's stock collective is {stock}")
    return codec


class CountedAllGather(QSDPComm, AllGather):
    """FSDP2's default all-gather (the same call, bit-identical), recording its bytes under ``fsdp.all_gather``.

    Args:
        meter: where bytes are recorded.
        buffers: the model's buffer pool.
    """

    def __init__(self, meter: WireMeter, buffers: BufferPool | None = None) -> None:
        super().__init__(buffers)
        self.meter = meter

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
        return counted_all_gather(output_tensor, input_tensor, group, self.meter, KIND_FSDP_AG, async_op=async_op)


class QuantizedAllGather(QSDPComm, AllGather):
    """FSDP2 ``AllGather`` that gathers this rank's shard as k-bit codes plus bucket metadata.

    Every rank, the owner included, decodes every chunk from the gathered bytes, so all ranks
    compute with bit-identical unsharded weights. Forward and backward re-gathers of one step use
    the same seed and therefore decode the same weights. With ``async_op`` (FSDP2 prefetching, see
    :func:`qaccel.fsdp.apply_prefetch`) the returned work decodes when FSDP2 waits on it.

    Args:
        plan: the unit's segment map (``plan.enabled``).
        codec: the weight quantizer.
        seeds: the model's seed schedule.
        meter: where bytes are recorded (kind ``qsdp.all_gather``).
        buffers: the model's buffer pool.
        timer: splits each call into encode / transport / decode (``qaccel bench comm``; None: off).
            :meth:`qaccel.fsdp.QSDPHandle.set_phase_timer` swaps it between calls.

    Raises:
        ValueError: ``codec`` is None or the plan is not enabled (that unit's comm is :class:`CountedAllGather`).
    """

    def __init__(
        self, plan: UnitPlan, codec: WireCodec, seeds: SeedSchedule, meter: WireMeter, buffers: BufferPool | None = None, *, timer: PhaseTimer | None = None
    ) -> None:
        super().__init__(buffers)
        self.codec = _require_quantized("QuantizedAllGather", plan, codec)
        self.plan = plan
        self.seeds = seeds
        self.meter = meter
        self.timer = timer

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
        layout = self.plan.layout(self.codec, input_tensor.numel(), input_tensor.dtype)
        seed = self.seeds.weight_seed(self.plan.index, group.rank())
        # A rotated codec decodes every owner's chunk with that owner's signs, hence its seed.
        owner_seeds = [self.seeds.weight_seed(self.plan.index, owner) for owner in range(group.size())] if layout.spec.rotated else None
        return quantized_all_gather(
            output_tensor, input_tensor, group, layout, seed, self.meter, KIND_QSDP_AG,
            owner_seeds=owner_seeds, async_op=async_op, buffers=self.buffers, timer=self.timer,
        )  # fmt: skip


class CountedReduceScatter(QSDPComm, ReduceScatter):
    """FSDP2's default reduce-scatter with FSDP2's own op (bit-identical), recording its bytes under ``fsdp.reduce_scatter``.

    Args:
        plan: the unit's gradient segment map (its size says which allocation is the output).
        meter: where bytes are recorded.
        buffers: the model's buffer pool.
    """

    needs_forced_sum: ClassVar[bool] = False  # FSDP's own op: the unit stays bit-identical to stock

    def __init__(self, plan: UnitPlan, meter: WireMeter, buffers: BufferPool | None = None) -> None:
        super().__init__(buffers, pool_min_numel=2 * plan.numel)
        self.plan = plan
        self.meter = meter

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp, async_op: bool = False
    ) -> dist.Work | None:
        return counted_reduce_scatter(output_tensor, input_tensor, group, op, self.meter, KIND_FSDP_RS, async_op=async_op)


class QuantizedReduceScatter(QSDPComm, ReduceScatter):
    """FSDP2 ``ReduceScatter`` as an all-to-all of k-bit chunks, summed in fp32: a SUM transport.

    The installer forces ``ReduceOp.SUM`` on the unit (``set_force_sum_reduction_for_comms``, see
    :attr:`needs_forced_sum`) and leaves the divide factor alone, so FSDP2 itself divides the summed
    shard afterwards, by the data-parallel size or by a factor the user set with
    ``set_gradient_divide_factor`` (before or after the install), in ``reduce_dtype``.
    ``ReduceOp.AVG`` (what FSDP2 passes if forced SUM was switched off again and no factor is set)
    is honoured too: the fp32 sum is divided by the group size. ``PREMUL_SUM`` and other ops are
    refused, because the comm cannot read their scale back; gloo's AVG (pytorch/pytorch#162338) is
    never used.

    Each call of a unit within one optimizer step draws fresh gradient noise (see
    :class:`qaccel.fsdp.SeedSchedule`), so micro-batches that each reduce-scatter do not repeat it.

    Error feedback (``QSDPConfig.grad_error_feedback``, ``error_dtype``): the unit keeps, per rank,
    what quantization left out of the chunks it sent (``error``, ``(P-1) x`` the output's
    elements), allocated zero on the first call and carried from call to call, micro-batches
    included; ``error`` is saved as it is and :meth:`load_error_state` restores it.

    Args:
        plan: the unit's gradient segment map (``plan.enabled``).
        codec: the gradient quantizer.
        seeds: the model's seed schedule.
        meter: where bytes are recorded (kind ``qsdp.reduce_scatter``).
        buffers: the model's buffer pool.
        error_dtype: the error-feedback store (float32 or bfloat16), or ``None`` for none.
        owner_offset: hierarchical QSDP's ``replica index * shard size``, so gradient seeds name the
            rank among all ranks and the replicas of a shard draw independent noise (0 on a 1-D mesh).
        timer: as for :class:`QuantizedAllGather`.

    Raises:
        ValueError: ``codec`` is None or the plan is not enabled (that unit's comm is :class:`CountedReduceScatter`).
    """

    needs_forced_sum: ClassVar[bool] = True  # a SUM transport: FSDP2 divides afterwards

    def __init__(
        self,
        plan: UnitPlan,
        codec: WireCodec,
        seeds: SeedSchedule,
        meter: WireMeter,
        buffers: BufferPool | None = None,
        error_dtype: torch.dtype | None = None,
        *,
        owner_offset: int = 0,
        timer: PhaseTimer | None = None,
    ) -> None:
        super().__init__(buffers, pool_min_numel=2 * plan.numel)
        self.codec = _require_quantized("QuantizedReduceScatter", plan, codec)
        self.plan = plan
        self.seeds = seeds
        self.meter = meter
        self.error_dtype = error_dtype
        self.owner_offset = owner_offset
        self.timer = timer
        self.error: torch.Tensor | None = None

    def load_error_state(self, error: torch.Tensor | None) -> None:
        """Restore a saved buffer (``None``: start from zero), cast to this unit's store dtype."""
        if error is not None and self.error_dtype is None:
            raise ValueError(f"QSDP unit {self.plan.name}: a saved error-feedback buffer, but error feedback is off")
        self.error = None if error is None else error.to(self.error_dtype).clone()

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp, async_op: bool = False
    ) -> dist.Work | None:
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
        unit, call = self.plan.index, self.seeds.next_grad_call(self.plan.index)
        seeds = [self.seeds.grad_seed(unit, self.owner_offset + rank, dest, call) for dest in range(world)]
        # A rotated codec sums each source's chunk with that source's signs, hence its seed.
        source_seeds = [self.seeds.grad_seed(unit, self.owner_offset + source, rank, call) for source in range(world)] if layout.spec.rotated else None
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
