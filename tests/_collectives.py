"""One recorder of torch.distributed's collectives, the independent byte reference of every wire-bytes test.

Inside a rank, :class:`CollectiveRecorder` wraps torch.distributed's collective functions (as torchao's comm-size
test wraps the collective) and keeps one :class:`CollectiveCall` per outermost call: the torch function, its
family, the global ranks of its group (and the group's label), and the bytes handed in. Nothing here reads
qaccel's wire meter, so a test comparing the meter with these numbers compares two independent sources.

Sent bytes follow the meter's convention for a collective of P ranks (docs/zero_one_adam.md, "Bytes"):
all-reduce 2 (P-1)/P x input (a ring), all-gather (P-1) x input, reduce-scatter (P-1) x output, all-to-all every
split but the rank's own ((P-1)/P x input for equal splits).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from unittest import mock

import torch
import torch.distributed as dist

__all__ = ["FAMILIES", "CollectiveCall", "CollectiveRecorder", "ring_all_reduce"]

# Each wrapped torch.distributed function and its family.
FAMILIES = {
    "all_reduce": "all_reduce",
    "all_to_all_single": "all_to_all",
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "broadcast": "broadcast",
}


def ring_all_reduce(nbytes: int, ranks: int) -> int:
    """docs/zero_one_adam.md, "Bytes": a ring all-reduce of nbytes sends 2 (N-1) / N x nbytes per rank."""
    return 2 * (ranks - 1) * nbytes // ranks


def _nbytes(value: torch.Tensor | Sequence[torch.Tensor]) -> int:
    if isinstance(value, list | tuple):
        return sum(t.numel() * t.element_size() for t in value)
    return value.numel() * value.element_size()


@dataclass(frozen=True)
class CollectiveCall:
    """One call into torch.distributed, as it was handed in.

    Attributes:
        name: the torch.distributed function called.
        family: all_reduce, all_gather, reduce_scatter, all_to_all or broadcast.
        group: the group's label (see :class:`CollectiveRecorder`).
        group_ranks: the global ranks of the group, sorted.
        group_rank: this rank's index in the group.
        payload_bytes: bytes handed in (a reduce-scatter: its output, one rank's share).
        split_bytes: an all-to-all's bytes per destination, where the caller gave splits; else ().
    """

    name: str
    family: str
    group: str
    group_ranks: tuple[int, ...]
    group_rank: int
    payload_bytes: int
    split_bytes: tuple[int, ...] = ()

    @property
    def op(self) -> str:
        """The function's name, all-gather's variants as one (``all_gather_into_tensor`` aliases ``all_gather_single``)."""
        return self.family if self.family == "all_gather" else self.name

    @property
    def sent_bytes(self) -> int:
        """Bytes this rank sends, by the meter's convention (module docstring)."""
        peers = len(self.group_ranks)
        if self.family == "all_reduce":
            return ring_all_reduce(self.payload_bytes, peers)
        if self.family == "all_to_all":
            if self.split_bytes:
                return sum(n for j, n in enumerate(self.split_bytes) if j != self.group_rank)
            return (peers - 1) * self.payload_bytes // peers
        if self.family in ("all_gather", "reduce_scatter"):
            return (peers - 1) * self.payload_bytes
        raise ValueError(f"CollectiveCall.sent_bytes: no convention for {self.name!r} (family {self.family!r})")

    @property
    def peer_bytes(self) -> int:
        """Bytes sent to one peer: the largest split of an all-to-all, the payload of any other collective."""
        if self.family != "all_to_all":
            return self.payload_bytes
        if self.split_bytes:
            return max((n for j, n in enumerate(self.split_bytes) if j != self.group_rank), default=0)
        return self.payload_bytes // len(self.group_ranks)

    def as_row(self) -> list:
        """[family, group, payload bytes, [split bytes]]: the rows of tests/dist/wire_bytes_record.json."""
        return [self.family, self.group, self.payload_bytes, list(self.split_bytes)]


class CollectiveRecorder:
    """Wraps torch.distributed's collectives (``FAMILIES``) and records each outermost call.

    Args:
        groups: labels of process groups by their global ranks, checked in order; a call's group gets the first
            label whose ranks it has (``group=None`` is the world).
        other: the label of any other group; ``{ranks}`` in it is replaced by the group's sorted ranks.

    Example::

        recorder = CollectiveRecorder({"replica": [0, 2], "shard": [0, 1]})
        with recorder.recording():
            loss.backward()
        inter_node = recorder.sent_bytes(group="replica")
    """

    def __init__(self, groups: Mapping[str, Sequence[int]] | None = None, other: str = "other") -> None:
        self.groups = {label: tuple(sorted(ranks)) for label, ranks in (groups or {}).items()}
        self.other = other
        self.calls: list[CollectiveCall] = []
        self._inside = threading.local()  # one wrapped API may call another: count the outermost only

    def _describe(self, name: str, arguments: Mapping) -> CollectiveCall:
        group = arguments.get("group")
        ranks = tuple(sorted(dist.get_process_group_ranks(group))) if group is not None else tuple(range(dist.get_world_size()))
        label = next((lbl for lbl, members in self.groups.items() if members == ranks), None)
        label = label if label is not None else self.other.format(ranks=list(ranks))
        splits = ()
        if name == "all_to_all_single":
            tensor, rows = arguments["input"], arguments.get("input_split_sizes")
            row_bytes = tensor[0].numel() * tensor.element_size() if tensor.dim() > 1 else tensor.element_size()
            splits = tuple(n * row_bytes for n in rows) if rows else ()
        elif name in ("reduce_scatter_tensor", "reduce_scatter_single"):
            tensor = arguments["output"]
        elif name in ("all_gather_single", "all_gather_into_tensor"):
            tensor = arguments["input_tensor"]
        else:  # all_reduce, all_gather (a list out, one tensor in), broadcast
            tensor = arguments["tensor"]
        return CollectiveCall(name, FAMILIES[name], label, ranks, dist.get_rank(group), _nbytes(tensor), splits)

    @contextlib.contextmanager
    def recording(self) -> Iterator[CollectiveRecorder]:
        """Wrap the collectives for the body of the ``with``; the originals come back on exit."""
        originals = {name: getattr(dist, name) for name in FAMILIES if hasattr(dist, name)}

        def wrap(name, fn):
            signature = inspect.signature(fn)

            def recorded(*args, **kwargs):
                if getattr(self._inside, "active", False):
                    return fn(*args, **kwargs)
                self.calls.append(self._describe(name, signature.bind(*args, **kwargs).arguments))
                self._inside.active = True
                try:
                    return fn(*args, **kwargs)
                finally:
                    self._inside.active = False

            return recorded

        with mock.patch.multiple(dist, **{name: wrap(name, fn) for name, fn in originals.items()}):
            yield self

    def take(self) -> list[CollectiveCall]:
        """The calls recorded so far, which are then forgotten."""
        taken, self.calls = self.calls, []
        return taken

    def select(self, group: str | None = None, family: str | None = None) -> list[CollectiveCall]:
        """The recorded calls on ``group`` (a label) and of ``family``; None: any."""
        return [c for c in self.calls if group in (None, c.group) and family in (None, c.family)]

    def sent_bytes(self, group: str | None = None, family: str | None = None) -> int:
        """Bytes sent by the selected calls (see :meth:`select`), by the meter's convention."""
        return sum(c.sent_bytes for c in self.select(group, family))

    def op_counts(self, group: str | None = None) -> Counter[str]:
        """Calls per :attr:`CollectiveCall.op` on ``group`` (None: any)."""
        return Counter(c.op for c in self.select(group))

    def byte_rows(self, families: Sequence[str] = ("all_gather", "reduce_scatter", "all_to_all")) -> list[tuple[str, int, int]]:
        """(family, sent bytes, bytes to one peer) of each recorded call of ``families``, in call order."""
        return [(c.family, c.sent_bytes, c.peer_bytes) for c in self.calls if c.family in families]

    def total_calls(self) -> int:
        return len(self.calls)
