"""Wire bytes in the Trainer's logs.

The accelerator's :class:`qaccel.comm.WireMeter` counts every byte qaccel's collectives put on the
wire, per kind (``qsdp.all_gather``, ``onebit.all_to_all``, ...), from buffer sizes. Each Trainer log
entry gets the bytes this rank sent since the previous entry (``wire_bytes``, and per kind that sent
any, ``wire_bytes/<kind>``) and since the start (``wire_bytes_total``). Stock collectives qaccel does not
run (e.g. plain DDP's gradient all-reduce with AdamW) are not counted.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from ..comm import WireMeter

__all__ = ["WireLog", "WireStepCallback"]


class WireLog:
    """Turns the meter's running totals into per-interval log values."""

    def __init__(self, meter: WireMeter) -> None:
        self.meter = meter
        self._logged: dict[str, int] = {}

    def entries(self) -> dict[str, int]:
        """Bytes sent since the last call (total and per kind) and since the start."""
        totals = {kind: tally.sent_bytes for kind, tally in self.meter.totals().items()}
        interval = {kind: sent - self._logged.get(kind, 0) for kind, sent in totals.items()}
        self._logged = totals
        values = {"wire_bytes": sum(interval.values()), "wire_bytes_total": sum(totals.values())}
        values.update({f"wire_bytes/{kind}": sent for kind, sent in sorted(interval.items()) if sent})
        return values


class WireStepCallback(TrainerCallback):
    """Closes the meter's step after every optimizer step, so ``comm_stats()["last_step"]`` is that step."""

    def __init__(self, meter: WireMeter) -> None:
        self.meter = meter

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.meter.end_step()
