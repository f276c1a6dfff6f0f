"""The port of the 1-bit optimizers: where they run (:class:`OneBitPlacement`) and what a transport may use (:class:`OneBitPort`).

A transport moves a 1-bit optimizer's traffic: the DDP hook (:mod:`qaccel.optim._ddp_hook`), the
FSDP2 all-reduce hook on HSDP shards (:mod:`qaccel.optim._hsdp_hook`) and the backward overlap of the
1-bit all-reduce (:mod:`qaccel.optim._overlap`). Each is given the optimizer and uses only
:class:`OneBitPort`; the hook that installs it hands the optimizer one :class:`OneBitPlacement`
(``optimizer.attach(placement)``), once. Nothing else changes where an optimizer runs, so the
optimizer's own collectives (clipping norms, replica checks, resync) and its transports always agree on
the group, the meter and the meter's kinds.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from ..comm import OneBitLayout, WireMeter, default_meter
from ._schedule import CommPlan, StepKind
from ._units import Unit

if TYPE_CHECKING:
    from ._schedule import OneBitAdamSchedule, ZeroOneAdamSchedule

__all__ = ["OneBitPlacement", "OneBitPort"]


@dataclass(frozen=True, kw_only=True, eq=False)
class OneBitPlacement:
    """Where a 1-bit optimizer runs: fixed when its comm hook is registered.

    Attributes:
        process_group: the ranks that average (the DDP model's group, or on HSDP the replicas of this
            rank's shard); None means the default group, or world size 1 without torch.distributed.
        shard_group: HSDP only: the ranks this rank's parameters are sharded over (one node). Gradient
            norms add the shards' squares over it; the meter then records the optimizer's traffic
            across replicas as ``hsdp.onebit.*``.
        wire_meter: where every collective of the optimizer and its transports records its bytes.
        overlap_comm: start the 1-bit all-reduce in the DDP hook, during backward, on a process group of
            its own with the ranks of ``process_group`` (:mod:`qaccel.optim._overlap`).
    """

    process_group: dist.ProcessGroup | None = None
    shard_group: dist.ProcessGroup | None = None
    wire_meter: WireMeter = default_meter
    overlap_comm: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.wire_meter, WireMeter):
            raise TypeError(f"OneBitPlacement.wire_meter: expected a qaccel.comm.WireMeter, got {type(self.wire_meter).__name__}")
        if not isinstance(self.overlap_comm, bool):
            raise TypeError(f"OneBitPlacement.overlap_comm={self.overlap_comm!r}: must be True or False")
        if self.overlap_comm and self.shard_group is not None:
            raise NotImplementedError("OneBitPlacement: overlap_comm runs in the DDP hook; HSDP shards (shard_group) have none")

    @property
    def kind_prefix(self) -> str:
        """Prefix of the meter's kinds for the optimizer's collectives (``<prefix>.all_to_all``, ...)."""
        return "onebit" if self.shard_group is None else "hsdp.onebit"

    def same_as(self, other: OneBitPlacement) -> bool:
        """The same groups and meter (identity: two meters with equal counts are still two meters) and overlap."""
        return all(getattr(self, f.name) is getattr(other, f.name) for f in fields(self))

    def __repr__(self) -> str:
        def group(g: dist.ProcessGroup | None) -> str:
            return "default" if g is None else f"{g.size()} ranks"

        return (
            f"OneBitPlacement(process_group={group(self.process_group)}, shard_group="
            f"{None if self.shard_group is None else group(self.shard_group)}, overlap_comm={self.overlap_comm})"
        )


class OneBitPort(Protocol):
    """What a transport of a 1-bit optimizer's traffic uses, and nothing more.

    - the step kind: :attr:`comm_plan` (``full_allreduce_next``, ``next_kind``) and ``schedule.step``;
    - where it runs: :attr:`placement` (after :meth:`attach`);
    - the payload of a unit: :meth:`units` and :meth:`unit_payload`;
    - where the average goes: :meth:`onebit_buffers` (the layout and the error-feedback buffers the
      1-bit all-reduce of those units reads and updates); the averages themselves go back to the
      optimizer's step, which applies them;
    - whether the next backward may start the 1-bit all-reduce: :meth:`overlap_blocker`.

    :class:`qaccel.optim.OneBitOptimizerBase` implements it.
    """

    comm_plan: CommPlan
    schedule: ZeroOneAdamSchedule | OneBitAdamSchedule
    param_groups: list[dict]

    @property
    def placement(self) -> OneBitPlacement: ...

    def attach(self, placement: OneBitPlacement) -> None: ...

    def world_size(self) -> int: ...

    def units(self) -> list[Unit]: ...

    def unit_payload(self, kind: StepKind, unit: Unit, grad: torch.Tensor) -> torch.Tensor: ...

    def onebit_buffers(self, units: list[Unit]) -> tuple[list[OneBitLayout], list[torch.Tensor], list[torch.Tensor]]: ...

    def overlap_blocker(self) -> str | None: ...
