"""Exact wire-byte accounting for every collective qaccel issues.

Each collective records the bytes this rank puts on the wire and takes off it, computed from the
buffer sizes of the call (never estimated), under a *kind* such as ``"qsdp.all_gather"`` or
``"onebit.all_to_all"``. A :class:`WireMeter` keeps running totals and the tally of the current
optimizer step; ``end_step()`` closes the step so per-step figures can be logged and reset.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import asdict, dataclass

__all__ = ["CollectiveTally", "WireMeter", "default_meter", "ring_all_gather_bytes", "ring_all_reduce_bytes"]


@dataclass
class CollectiveTally:
    """Counts for one collective kind: calls (communication rounds) and bytes per direction."""

    calls: int = 0
    sent_bytes: int = 0
    recv_bytes: int = 0

    def add(self, other: CollectiveTally) -> None:
        self.calls += other.calls
        self.sent_bytes += other.sent_bytes
        self.recv_bytes += other.recv_bytes


def ring_all_gather_bytes(chunk_bytes: int, world_size: int) -> int:
    """Bytes one rank sends (and receives) in an all-gather of ``chunk_bytes`` per rank."""
    return (world_size - 1) * chunk_bytes


def ring_all_reduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``nbytes``: ``2 (N-1) nbytes / N``."""
    return 2 * (world_size - 1) * nbytes // world_size


class WireMeter:
    """Thread-safe per-kind tallies: running totals plus the current step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total: dict[str, CollectiveTally] = defaultdict(CollectiveTally)
        self._step: dict[str, CollectiveTally] = defaultdict(CollectiveTally)
        self._steps_closed = 0
        self._last_step: dict[str, CollectiveTally] = {}

    def record(self, kind: str, *, sent_bytes: int, recv_bytes: int, calls: int = 1) -> None:
        """Add one collective call of ``kind`` that sent/received the given byte counts."""
        if sent_bytes < 0 or recv_bytes < 0:
            raise ValueError(f"WireMeter.record({kind!r}): negative byte count {sent_bytes=} {recv_bytes=}")
        tally = CollectiveTally(calls, int(sent_bytes), int(recv_bytes))
        with self._lock:
            self._total[kind].add(tally)
            self._step[kind].add(tally)

    def end_step(self) -> dict[str, CollectiveTally]:
        """Close the current step; return its tallies and start a new one."""
        with self._lock:
            closed = dict(self._step)
            self._last_step = closed
            self._step = defaultdict(CollectiveTally)
            self._steps_closed += 1
        return closed

    def reset(self) -> None:
        with self._lock:
            self._total.clear()
            self._step.clear()
            self._last_step = {}
            self._steps_closed = 0

    def totals(self) -> dict[str, CollectiveTally]:
        with self._lock:
            return {k: CollectiveTally(**asdict(v)) for k, v in self._total.items()}

    def current_step(self) -> dict[str, CollectiveTally]:
        with self._lock:
            return {k: CollectiveTally(**asdict(v)) for k, v in self._step.items()}

    def snapshot(self) -> dict:
        """JSON-ready view: totals, the last closed step and the number of closed steps."""
        with self._lock:
            return {
                "steps": self._steps_closed,
                "total": {k: asdict(v) for k, v in sorted(self._total.items())},
                "last_step": {k: asdict(v) for k, v in sorted(self._last_step.items())},
                "total_sent_bytes": sum(v.sent_bytes for v in self._total.values()),
                "total_recv_bytes": sum(v.recv_bytes for v in self._total.values()),
            }


default_meter = WireMeter()
"""The process-wide meter that qaccel collectives record into unless given another."""
