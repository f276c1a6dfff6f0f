"""Where the time of a quantized collective goes: encode, transport, decode.

A :class:`PhaseTimer` is optional (``None`` costs nothing): ``qaccel bench comm`` hands one to the
QSDP comms to split each collective's wall-clock into its phases. On CUDA the phases are timed
after a device synchronize, so use it for measurements, not in production runs.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = ["PhaseTimer", "PhaseTotals", "PHASES"]

PHASES = ("encode", "transport", "decode")


@dataclass
class PhaseTotals:
    """Seconds per phase and the number of collective calls, for one collective kind."""

    calls: int = 0
    encode: float = 0.0
    transport: float = 0.0
    decode: float = 0.0

    def as_dict(self) -> dict:
        return {"calls": self.calls, **{phase: getattr(self, phase) for phase in PHASES}}


class PhaseTimer:
    """Accumulates per-kind phase times of collectives (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, PhaseTotals] = defaultdict(PhaseTotals)

    @contextmanager
    def phase(self, kind: str, phase: str, device: torch.device):
        if phase not in PHASES:
            raise ValueError(f"PhaseTimer.phase: phase={phase!r}: must be one of {', '.join(PHASES)}")
        _synchronize(device)
        started = time.perf_counter()
        try:
            yield
        finally:
            _synchronize(device)
            elapsed = time.perf_counter() - started
            with self._lock:
                totals = self._totals[kind]
                setattr(totals, phase, getattr(totals, phase) + elapsed)

    def count_call(self, kind: str) -> None:
        with self._lock:
            self._totals[kind].calls += 1

    def totals(self) -> dict[str, PhaseTotals]:
        with self._lock:
            return {kind: PhaseTotals(**vars(t)) for kind, t in self._totals.items()}

    def reset(self) -> None:
        with self._lock:
            self._totals.clear()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
