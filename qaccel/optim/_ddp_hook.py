"""DDP communication hook of the 1-bit optimizers: full all-reduce only when the comm plan says so.

DDP all-reduces every gradient bucket by default. 0/1 Adam and 1-bit Adam need the averaged gradient
only on FULL steps (variance / warm-up steps) and the *local* gradient on every other step, which they
compress themselves. The hook reads the optimizer's :class:`~qaccel.optim.CommPlan` (fixed at the end of
the previous optimizer step, as DeepSpeed fixes ``enable_backward_allreduce``) and either runs the
stock averaging all-reduce or returns the bucket untouched. It keeps no per-bucket state, so DDP's bucket
rebuild after the first iteration does not matter; error feedback lives in the optimizer.

With ``overlap_comm`` (on by default) the hook also starts the 1-bit all-reduce of the units each bucket
completes, on compressed steps, and still hands DDP the local gradient (:mod:`qaccel.optim._overlap`).

With an fp16 ``GradScaler`` each rank decides on its own whether to skip a step, which would split the
replicas when gradients are local. With ``agree_on_overflow=True`` the hook ORs a non-finite flag over
the ranks on the last bucket of every local-gradient backward (one 4-byte all-reduce, as DeepSpeed's
overflow check) and, if any rank overflowed, fills that bucket with NaN on every rank so that every
scaler skips together.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at registration and
# rejects string annotations ("bucket annotation should be dist.GradBucket").
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from ..comm import WireMeter, default_meter, ring_all_reduce_bytes
from ._base import OneBitOptimizerBase
from ._overlap import OneBitOverlap
from ._port import OneBitPlacement
from ._schedule import CommPlan

__all__ = ["OneBitCommHookState", "onebit_comm_hook", "register_ddp_comm_hook"]


class OneBitCommHookState:
    """State of :func:`onebit_comm_hook`.

    Args:
        plan: the optimizer's comm plan.
        process_group: the DDP model's process group (None: default group).
        wire_meter: where the hook records the all-reduce bytes.
        agree_on_overflow: enable the fp16 overflow agreement described in the module docstring.
        overlap: the optimizer's backward overlap, which each bucket is handed to (None: no overlap).
    """

    def __init__(
        self,
        plan: CommPlan,
        process_group: dist.ProcessGroup | None = None,
        wire_meter: WireMeter | None = None,
        agree_on_overflow: bool = False,
        overlap: OneBitOverlap | None = None,
    ) -> None:
        self.plan = plan
        self.overlap = overlap
        self.process_group = process_group
        self.wire_meter = default_meter if wire_meter is None else wire_meter
        self.agree_on_overflow = agree_on_overflow
        self._overflow: torch.Tensor | None = None

    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)


def onebit_comm_hook(state: OneBitCommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: averaging all-reduce on FULL steps, the local gradient otherwise."""
    buffer = bucket.buffer()
    world_size = state.world_size()
    if state.plan.full_allreduce_next:
        nbytes = ring_all_reduce_bytes(buffer.numel() * buffer.element_size(), world_size)
        state.wire_meter.record("ddp.all_reduce", sent_bytes=nbytes, recv_bytes=nbytes)
        return allreduce_hook(state.process_group, bucket)
    if state.overlap is not None:
        state.overlap.bucket_ready(bucket.parameters(), bucket.gradients())
    if state.agree_on_overflow:
        # 1.0 if this bucket holds an inf or NaN; one bool temporary of the bucket's length
        local = torch.isfinite(buffer).all().logical_not().to(torch.float32).reshape(1)
        state._overflow = local if state._overflow is None else torch.maximum(state._overflow, local)
        if bucket.is_last():
            flag, state._overflow = state._overflow, None
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=state.process_group)
            nbytes = ring_all_reduce_bytes(4, world_size)
            state.wire_meter.record("ddp.overflow_flag_all_reduce", sent_bytes=nbytes, recv_bytes=nbytes)
            # NaN everywhere iff some rank overflowed, decided on the device: `if flag.item()` would make
            # the host wait for the all-reduce in every backward.
            buffer.masked_fill_(flag.to(torch.bool), float("nan"))
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


def register_ddp_comm_hook(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    optimizer: OneBitOptimizerBase,
    *,
    wire_meter: WireMeter | None = None,
    agree_on_overflow: bool = False,
) -> OneBitCommHookState:
    """Install :func:`onebit_comm_hook` on ``ddp_model`` and attach ``optimizer`` to its process group.

    ``qaccel.Accelerator.prepare`` calls this; plain-PyTorch DDP scripts call it once after wrapping the
    model. Without it DDP all-reduces every step, and the 1-bit optimizer would compress gradients that
    were already averaged (correct but wasteful, and not the algorithm).

    The optimizer is attached (:meth:`~qaccel.optim.OneBitOptimizerBase.attach`) to a
    :class:`~qaccel.optim.OneBitPlacement` of the DDP group and ``wire_meter``. With the optimizer's
    ``overlap_comm`` on (and no ``agree_on_overflow``, whose skipped steps must leave the state alone)
    that also creates the process group of the overlap thread, with the DDP group's ranks: every rank of
    that group must call this, as it must wrap the model.

    Raises:
        TypeError: for a model that is not DDP or an optimizer that is not a qaccel 1-bit optimizer.
        RuntimeError: if the optimizer already runs on another group or meter, or the model already
            has a comm hook (DDP allows one; the optimizer then stays attached to the model's group).
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"register_ddp_comm_hook: expected a DistributedDataParallel model, got {type(ddp_model).__name__}")
    if not isinstance(optimizer, OneBitOptimizerBase):
        raise TypeError(f"register_ddp_comm_hook: expected ZeroOneAdam or OneBitAdam, got {type(optimizer).__name__}")
    placement = OneBitPlacement(
        process_group=ddp_model.process_group,
        wire_meter=optimizer.wire_meter if wire_meter is None else wire_meter,
        overlap_comm=optimizer.config.overlap_comm and not agree_on_overflow,
    )
    optimizer.attach(placement)  # collective with overlap_comm: every rank of the DDP group registers the hook
    state = OneBitCommHookState(
        optimizer.comm_plan, placement.process_group, placement.wire_meter, agree_on_overflow, optimizer.comm_overlap
    )
    try:
        ddp_model.register_comm_hook(state, onebit_comm_hook)
    except RuntimeError as err:
        raise RuntimeError(
            f"register_ddp_comm_hook: the DDP model already has a communication hook ({err}); 0/1 Adam and "
            "1-bit Adam need their own, so leave DistributedDataParallelKwargs.comm_hook at NO"
        ) from None
    return state
