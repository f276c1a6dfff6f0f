"""Overlap the reduce-scatter with backward on CPU: start the transport, finish it before anyone reads a gradient.

On CPU FSDP2 calls the reduce-scatter comm synchronously in the autograd thread and, right after
it returns, works on the reduced shard (``foreach_reduce`` in torch 2.13): divides it by the
post-divide factor, casts it to the parameters' dtype, and either makes views of it the sharded
gradients or adds them into gradients that are already there (accumulation across micro-batches).
The comm therefore cannot simply return with the transport still running.

What it does instead (``docs/qsdp.md``, "Overlap"): the comm starts the transport into a private
buffer and fills FSDP2's output with ``-0.0``, the one value for which all of FSDP2's work is an
exact no-op: ``-0.0 / f`` is ``-0.0`` for a positive factor, a cast keeps it, a fresh gradient
becomes ``-0.0`` and ``g + (-0.0)`` is ``g`` bit for bit (``+0.0`` and ``-0.0`` included). The
pending reduce-scatter is finished later, in call order: when the next unit's reduce-scatter
starts, and at the end of backward (a callback queued on the autograd engine, which runs after
FSDP2's own root post-backward callback, since that one is queued first, by the root's
pre-backward hook). Finishing replays FSDP2's steps on the real sum (the same division and cast)
and adds each parameter's slice into its gradient: ``-0.0 + r`` is ``r``, ``g + (-0.0) + r`` is
``g + r``, so gradients, and everything computed from them, are bit-identical to the synchronous
comm.

A call falls back to the synchronous comm (results identical either way) whenever something may
read the reduced shard before backward ends, or FSDP2's steps cannot be replayed exactly: an
all-reduce hook on the unit (hierarchical QSDP's replica all-reduce reads the shard at once),
post-accumulate-grad hooks on a parameter (optimizer-in-backward), CPU offload, a call outside a
backward pass, a gradient for only some of the unit's parameters, a parameter sharded on a
dimension other than 0, a divide factor that is not a positive finite number, or a reduce op that
disagrees with FSDP2's own choice. :attr:`ReduceScatterOverlap.fallbacks` counts the reasons.

On CUDA nothing changes: FSDP2 orders the comm in its reduce-scatter stream, which already overlaps.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import _torch_internals as torch_internals
from ._comms import (
    AllGather,
    CountedAllGather,
    CountedReduceScatter,
    QSDPComm,
    QuantizedAllGather,
    QuantizedReduceScatter,
    ReduceScatter,
)
from ._plan import padded_shard_numel

__all__ = ["ReduceScatterOverlap", "FSDPTail", "OverlappedReduceScatter", "SettlingAllGather"]

logger = logging.getLogger(__name__)


class FSDPTail:
    """What FSDP2 does with one reduced shard after the comm returns, read at call time, replayable later.

    Args:
        fsdp_params: the unit's ``FSDPParam`` objects, in buffer order (all of them had a gradient).
        world: the reduce-scatter group size.
        post_divide: FSDP2's post-divide factor (``None``: none).
        orig_dtype: the dtype FSDP2 casts the reduced shard to (``None``: no cast).
    """

    def __init__(self, fsdp_params: list[Any], world: int, post_divide: float | None, orig_dtype: torch.dtype | None) -> None:
        self.fsdp_params = fsdp_params
        self.world = world
        self.post_divide = post_divide
        self.orig_dtype = orig_dtype

    def replay(self, reduced: torch.Tensor) -> None:
        """FSDP2's division and cast on the real sum, then add each slice into the gradient FSDP2 left.

        FSDP2 already made every gradient either ``-0.0`` (a fresh view of the placeholder output)
        or left it unchanged (``g + (-0.0)``), so one ``add_`` gives exactly what it would have made.
        """
        if self.post_divide is not None and self.post_divide != 1:
            reduced.div_(self.post_divide)  # FSDP2's _div_if_needed, in the reduce dtype
        if self.orig_dtype is not None and reduced.dtype != self.orig_dtype:
            reduced = reduced.to(self.orig_dtype)  # FSDP2's _to_dtype_if_needed
        offset = 0
        with torch.no_grad():
            for fsdp_param in self.fsdp_params:
                sharded_size = torch_internals.param_sharded_size(fsdp_param)
                piece = torch.as_strided(
                    reduced, size=sharded_size, stride=torch_internals.param_contiguous_sharded_stride(fsdp_param), storage_offset=offset
                )
                grad = torch_internals.sharded_param(fsdp_param).grad
                grad.to_local().add_(piece)  # FSDP2's own accumulation: `grad._local_tensor += new_sharded_grad`
                # FSDP2's per-parameter stride through the flat output: dim 0 padded to a multiple of the world size.
                offset += padded_shard_numel(torch_internals.sharded_param(fsdp_param).shape, self.world)


class _Pending:
    """One started reduce-scatter: its transport work (which writes ``reduced``) and FSDP2's steps to replay."""

    def __init__(self, work: dist.Work, reduced: torch.Tensor, tail: FSDPTail) -> None:
        self.work = work
        self.reduced = reduced
        self.tail = tail

    def finish(self) -> None:
        self.work.wait()  # transport, then decode + fp32 sum into `reduced`
        self.tail.replay(self.reduced)


class ReduceScatterOverlap:
    """The pending reduce-scatters of one model, and when to finish them (see the module docstring).

    One per model (:func:`qaccel.fsdp.install_qsdp`), shared by its units' reduce-scatter comms, so
    pending calls finish in the order they started, whichever unit they belong to.

    Attributes:
        overlapped: calls that returned with the transport running.
        fallbacks: calls that ran synchronously, by reason.
        dropped: calls whose backward raised before they finished (:meth:`drop_stale`).
    """

    def __init__(self) -> None:
        self._pending: list[_Pending] = []
        self._callback_tasks: set[int] = set()  # graph tasks that have our end-of-backward callback queued
        self.overlapped = 0
        self.fallbacks: Counter[str] = Counter()
        self.dropped = 0

    @property
    def pending(self) -> int:
        """Reduce-scatters started and not finished yet (0 whenever no backward is running)."""
        return len(self._pending)

    def plan(self, param_group: Any, process_group: dist.ProcessGroup, output: torch.Tensor, op: dist.ReduceOp) -> FSDPTail | str:
        """FSDP2's steps after this call, or the reason why this call must run synchronously.

        Args:
            param_group: the unit's ``FSDPParamGroup``.
            process_group: the reduce-scatter group FSDP2 handed the comm.
            output: FSDP2's reduce-scatter output.
            op: the reduce op FSDP2 handed the comm.
        """
        if torch_internals.current_graph_task_id() < 0:
            return "outside backward"
        if torch_internals.group_all_reduce_hook(param_group) is not None:
            return "all-reduce hook"  # hierarchical QSDP: the hook all-reduces the shard right after the comm
        world = process_group.size()
        fsdp_params = torch_internals.group_params(param_group)
        for fsdp_param in fsdp_params:
            if torch_internals.param_offloads_to_cpu(fsdp_param):
                return "cpu offload"
            if torch_internals.has_post_accumulate_grad_hooks(torch_internals.sharded_param(fsdp_param)):
                return "post-accumulate-grad hook"
            if torch_internals.param_shard_dim(fsdp_param) != 0:
                return "shard dim"
        if sum(padded_shard_numel(torch_internals.sharded_param(p).shape, world) for p in fsdp_params) != output.numel():
            return "partial gradients"  # some parameters had no gradient: FSDP2 reduced a subset
        # FSDP2's own choice, computed the way foreach_reduce computes it (a 1-D mesh: no all-reduce group).
        _, post_divide, expected_op, _ = torch_internals.gradient_divide_factors()(
            process_group, None, output.dtype, output.device.type,
            torch_internals.group_gradient_divide_factor(param_group), torch_internals.group_force_sum_reduction(param_group),
        )  # fmt: skip
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) or expected_op != op:
            return "reduce op"
        if post_divide is not None and not (math.isfinite(post_divide) and post_divide > 0):
            return "divide factor"  # -0.0 / f is -0.0 only for a positive finite f
        return FSDPTail(fsdp_params, world, post_divide, torch_internals.group_orig_dtype(param_group))

    def fall_back(self, reason: str) -> None:
        """Record a synchronous call and finish what is pending first, so calls complete in order."""
        self.fallbacks[reason] += 1
        self.drop_stale()
        self.finish()

    def start(self, start_transport: Callable[[torch.Tensor], dist.Work], output: torch.Tensor, tail: FSDPTail, reduced: torch.Tensor) -> None:
        """Finish what is pending, start this call's transport into ``reduced``, leave ``-0.0`` in ``output``.

        Args:
            start_transport: starts the collective asynchronously into its argument and returns the
                work that completes it (transport, decode and sum) on ``wait()``.
            output: FSDP2's reduce-scatter output, filled with the placeholder.
            tail: :meth:`plan`'s result for this call.
            reduced: where the transport writes the reduced shard (same numel and dtype as ``output``).
        """
        self.finish()
        work = start_transport(reduced)
        output.fill_(-0.0)
        self._pending.append(_Pending(work, reduced, tail))
        self.overlapped += 1
        task = torch_internals.current_graph_task_id()
        if task not in self._callback_tasks:
            # Queued during this backward: it runs after FSDP2's root callback, and again if that one
            # issues a reduce-scatter (a callback queued from a callback runs too).
            self._callback_tasks.add(task)
            torch_internals.queue_backward_callback(lambda: self._end_of_backward(task))

    def _end_of_backward(self, task: int) -> None:
        self._callback_tasks.discard(task)
        self.finish()

    def finish(self) -> None:
        """Complete every pending reduce-scatter, in the order they started (idempotent)."""
        while self._pending:
            self._pending.pop(0).finish()

    def drop_stale(self) -> None:
        """Outside backward, complete the transports still pending and drop their gradients.

        A backward that succeeds finishes everything in its end-of-backward callback, so a call still
        pending outside backward belongs to one that raised (the engine runs no callback then).
        FSDP2 treats that iteration as lost (``FSDPModule.reset_iter_state``), and the user may have
        zeroed the gradients since: adding the result now could corrupt the next step's gradients.
        The transport is still waited on, since every rank issued it.
        """
        if not self._pending or torch_internals.current_graph_task_id() >= 0:
            return
        logger.warning(
            "QSDP: %d reduce-scatter(s) of a backward pass that raised were still in flight; their gradients are "
            "dropped, as FSDP2 drops in-flight gradients of an aborted iteration (zero the gradients before retrying)",
            len(self._pending),
        )
        while self._pending:
            self._pending.pop(0).work.wait()
            self.dropped += 1
        self._callback_tasks.clear()


class OverlappedReduceScatter(QSDPComm, ReduceScatter):
    """A unit's reduce-scatter (quantized or counted) that, on CPU, returns with its transport running.

    A synchronous CPU call whose output FSDP2 only divides, casts and turns into gradients
    (:meth:`ReduceScatterOverlap.plan`) starts ``transport`` asynchronously into a pooled buffer,
    leaves ``-0.0`` in FSDP2's output and returns; ``overlap`` finishes it before backward ends. Any
    other call runs ``transport`` as it is. Seeds and error feedback advance at the call, as without
    the overlap, so gradients are bit-identical either way (``QSDPConfig.overlap_reduce_scatter``).

    Args:
        transport: the unit's reduce-scatter comm.
        overlap: the model's pending reduce-scatters.
        param_group: the unit's ``FSDPParamGroup``, whose use of the output a started call replays.
    """

    def __init__(self, transport: QuantizedReduceScatter | CountedReduceScatter, overlap: ReduceScatterOverlap, param_group: Any) -> None:
        super().__init__(transport.buffers, transport.pool_min_numel)
        self.transport = transport
        self.overlap = overlap
        self.param_group = param_group

    @property
    def needs_forced_sum(self) -> bool:
        return self.transport.needs_forced_sum

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp, async_op: bool = False
    ) -> dist.Work | None:
        if async_op or output_tensor.device.type != "cpu":
            return self.transport(output_tensor, input_tensor, group, op, async_op)  # FSDP2 orders it in a stream already
        tail = self.overlap.plan(self.param_group, group, output_tensor, op)
        if not isinstance(tail, FSDPTail):
            self.overlap.fall_back(tail)
            return self.transport(output_tensor, input_tensor, group, op, async_op)
        reduced = self.buffers.get(output_tensor.numel(), output_tensor.dtype, output_tensor.device).view(output_tensor.shape)
        self.overlap.start(lambda into: self.transport(into, input_tensor, group, op, async_op=True), output_tensor, tail, reduced)
        return None


class SettlingAllGather(QSDPComm, AllGather):
    """A unit's all-gather that first settles the reduce-scatters a backward that raised left pending.

    The first collective after such a backward is an all-gather (the next forward): it waits on the
    stale transports and drops their gradients (:meth:`ReduceScatterOverlap.drop_stale`) before
    anything new goes on the wire.

    Args:
        transport: the unit's all-gather comm.
        overlap: the model's pending reduce-scatters.
    """

    def __init__(self, transport: QuantizedAllGather | CountedAllGather, overlap: ReduceScatterOverlap) -> None:
        super().__init__(transport.buffers, transport.pool_min_numel)
        self.transport = transport
        self.overlap = overlap

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
        self.overlap.drop_stale()
        return self.transport(output_tensor, input_tensor, group, async_op)
