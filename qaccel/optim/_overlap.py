"""The 1-bit all-reduce of 0/1 Adam and 1-bit Adam, overlapped with backward (``overlap_comm``).

Without overlap the optimizer step compresses every unit, runs the 1-bit all-reduce and applies the
result, all after backward: a compressed step costs compute *plus* transfer. The payload of a unit
depends only on its own gradient and state (the momentum update is elementwise, ``docs/zero_one_adam.md``),
so it can be formed as soon as DDP hands the unit's gradient to the communication hook:

1. In the hook (autograd thread), for each unit whose parameters this bucket completes: the step
   kind's payload (0/1 Adam phase 1: the gradient; 1-bit Adam: ``m = b1 m + (1-b1) g``; 0/1 Adam sync:
   ``m``, ``lrs``, ``u`` updated and ``u (sqrt(v) + eps)``), then the worker side of the 1-bit
   all-reduce (:func:`qaccel.comm.start_compressed_allreduce`: error compensation, signs, scales).
   The gradient is read here and never again.
2. On one communication thread, in bucket order: both collectives, the server side and decoding
   (``finish``), while autograd computes the next buckets' gradients. The thread uses a process group
   of its own with the DDP group's ranks, so collectives the user or DDP issue on the DDP group in the
   meantime (a metrics gather, a buffer broadcast) can never interleave with it differently on
   different ranks.
3. The optimizer step waits for the thread and applies the averages (:meth:`OneBitOverlap.collect`).

Every unit goes through the same operations in the same order as without overlap, with its own scale
and error buffers, so results are bit-identical with overlap on and off (``tests/dist/test_onebit_overlap.py``).

It is active only where that holds: on CPU (gloo), without the optimizer's ``gradient_clipping`` (the
global norm is known only after backward) and without fp16 overflow agreement (a skipped step must not
have touched the state), never on the first step after loading a checkpoint (the replicas may be reset
first), and not once ``accelerator.clip_grad_norm_`` was seen (it changes gradients after backward).
Elsewhere the step runs the all-reduce itself, as before.
"""

from __future__ import annotations

import logging
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..comm import start_compressed_allreduce
from ._port import OneBitPort
from ._schedule import COMPRESSED_KINDS, StepKind
from ._units import Unit

__all__ = ["OneBitOverlap", "overlap_group"]

logger = logging.getLogger(__name__)


def overlap_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A new process group with the ranks of ``process_group`` (None: the default group), for the thread."""
    ranks = dist.get_process_group_ranks(process_group if process_group is not None else dist.group.WORLD)
    return dist.new_group(ranks=ranks, use_local_synchronization=True)


@dataclass
class _Round:
    """One backward's overlapped work, until the step collects it."""

    kind: StepKind
    step: int
    unit_of: dict[int, Unit]  # id(parameter) -> its unit
    missing: dict[Unit, int]  # parameters of the unit not seen yet
    grads: dict[int, torch.Tensor] = field(default_factory=dict)  # id(parameter) -> its gradient in the bucket
    jobs: list[tuple[list[Unit], Future]] = field(default_factory=list)
    lrs: dict[Unit, float] = field(default_factory=dict)  # lr each sync payload used


class OneBitOverlap:
    """Starts 1-bit all-reduces from the DDP hook and finishes them on a thread; see the module docstring.

    Only the optimizer's port (:class:`qaccel.optim.OneBitPort`) is used: the step kind, the units and
    their payloads, their error-feedback buffers, and the placement's meter.

    Args:
        optimizer: the 1-bit optimizer whose state and payloads are used.
        group: the thread's process group (:func:`overlap_group`).
    """

    def __init__(self, optimizer: OneBitPort, group: dist.ProcessGroup) -> None:
        # A weak reference: the optimizer holds this object, and a cycle would leave both, and the gloo
        # process group, to the cyclic collector, possibly at interpreter exit, where freeing a process
        # group can abort the process.
        self._optimizer_ref = weakref.ref(optimizer)
        self._group = group
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qaccel-onebit-comm")
        self._round: _Round | None = None
        self._disabled: str | None = None
        self.rounds_started = 0  # backwards whose all-reduce started in the hook (tests and benchmarks read it)

    @property
    def _optimizer(self) -> OneBitPort:
        optimizer = self._optimizer_ref()
        if optimizer is None:
            raise RuntimeError("the 1-bit optimizer of this DDP hook was deleted")
        return optimizer

    @property
    def in_flight(self) -> bool:
        """A backward started all-reduces that the optimizer step has not collected yet."""
        return self._round is not None

    def disable(self, reason: str) -> None:
        """Stop overlapping from the next backward on (the one in flight, if any, is still collected)."""
        if self._disabled is None:
            self._disabled = reason
            if self._round is not None:
                logger.warning(
                    "%s: %s; this step's 1-bit all-reduce had already started in backward from the gradient as it was "
                    "then, and from the next step on the optimizer step runs it",
                    type(self._optimizer).__name__, reason,
                )  # fmt: skip

    def inactive_reason(self) -> str | None:
        """Why the next backward cannot overlap, or None."""
        if self._disabled is not None:
            return self._disabled
        return self._optimizer.overlap_blocker()

    def bucket_ready(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """DDP hook: note a bucket's gradients and start the all-reduce of every unit it completes."""
        optimizer = self._optimizer
        kind = optimizer.comm_plan.next_kind
        if kind not in COMPRESSED_KINDS:
            return
        round_ = self._round
        if round_ is None:
            if self.inactive_reason() is not None:
                return
            units = optimizer.units()
            round_ = self._round = _Round(
                kind=kind,
                step=optimizer.schedule.step,
                unit_of={id(p): unit for unit in units for p in unit.params},
                missing={unit: len(unit.params) for unit in units},
            )
            self.rounds_started += 1
        ready = []
        for param, grad in zip(params, grads, strict=True):
            unit = round_.unit_of.get(id(param))
            if unit is None:  # in the DDP model but not in this optimizer
                continue
            if id(param) in round_.grads:
                raise RuntimeError(
                    f"{type(optimizer).__name__} with overlap_comm: a second backward reached the DDP hook before "
                    "optimizer.step(); the 1-bit all-reduce had already started from the first gradient. Accumulate "
                    "gradients under model.no_sync() (accelerator.accumulate does), or set overlap_comm=False"
                )
            round_.grads[id(param)] = grad
            round_.missing[unit] -= 1
            if round_.missing[unit] == 0:
                ready.append(unit)
        if not ready:
            return
        with torch.no_grad():
            payloads = []
            for unit in ready:
                payloads.append(optimizer.unit_payload(kind, unit, self._unit_grad(unit, round_)))
                if kind is StepKind.SYNC:
                    round_.lrs[unit] = optimizer.param_groups[unit.group_index]["lr"]
            layouts, worker_errors, server_errors = optimizer.onebit_buffers(ready)
            placement = optimizer.placement
            pending = start_compressed_allreduce(
                payloads, worker_errors, server_errors, layouts, group=self._group, meter=placement.wire_meter,
                kind_prefix=placement.kind_prefix,
            )  # fmt: skip
        round_.jobs.append((ready, self._executor.submit(pending.finish)))

    @staticmethod
    def _unit_grad(unit: Unit, round_: _Round) -> torch.Tensor:
        """What :func:`qaccel.optim._units.unit_grad` returns after backward, from the bucket's views."""
        pieces = [round_.grads[id(p)] for p in unit.params]
        if not unit.is_flat:
            grad = pieces[0].view(unit.shape)
            return grad if grad.dtype == torch.float32 else grad.float()
        return torch.cat([g.reshape(-1).float() for g in pieces])

    def collect(self, kind: StepKind) -> dict[Unit, torch.Tensor]:
        """Optimizer step: wait for this backward's all-reduces; the averaged payload of every unit they covered."""
        round_, self._round = self._round, None
        if round_ is None:
            return {}
        optimizer = self._optimizer
        if round_.kind is not kind or round_.step != optimizer.schedule.step:
            raise RuntimeError(
                f"{type(optimizer).__name__}: the all-reduce started in backward was for step {round_.step + 1} "
                f"({round_.kind.value}), but the optimizer is at step {optimizer.schedule.step + 1} ({kind.value})"
            )
        averaged: dict[Unit, torch.Tensor] = {}
        for units, job in round_.jobs:
            averaged.update(zip(units, job.result(), strict=True))
        for unit, lr in round_.lrs.items():
            now = optimizer.param_groups[unit.group_index]["lr"]
            if now != lr:
                raise RuntimeError(
                    f"{type(optimizer).__name__} with overlap_comm: param group {unit.group_index}'s lr changed from {lr} "
                    f"to {now} between backward and optimizer.step() on a sync step, whose "
                    "local update was formed in backward; change the lr after optimizer.step() (as LR schedulers do), "
                    "or set overlap_comm=False"
                )
        return averaged

    def refuse_in_flight(self, what: str) -> None:
        """Raise if a backward's all-reduce waits for its step (the state is then half-way through one)."""
        if self._round is not None:
            raise RuntimeError(
                f"{type(self._optimizer).__name__}.{what}: a 1-bit all-reduce started in backward (overlap_comm) has not "
                "been applied yet; call optimizer.step() first"
            )
