"""``qaccel.Accelerator``: an ``accelerate.Accelerator`` that installs qaccel's communication.

Accelerate has no plugin registry (``docs/accelerate.md``, "The subclass"), so the subclass calls
``super().prepare`` and then installs QSDP comms on the returned FSDP2 modules and the 0/1 Adam /
1-bit Adam DDP hook on the returned DDP model. Before ``super().__init__`` it runs a multi-process
launch on a machine without a GPU as ``cpu=True`` (:mod:`qaccel.integration._cpu_launch`). Everything
else is stock Accelerate.
"""

from __future__ import annotations

import gc
import inspect
from typing import Any

import accelerate

from ..comm import WireMeter, default_meter
from . import _cpu_launch, _qsdp
from ._zero_one_adam import OneBitWiring

_INIT_PARAMETERS = tuple(inspect.signature(accelerate.Accelerator.__init__).parameters)[1:]  # without self


def _as_keywords(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``Accelerator.__init__`` arguments all by name, so the hooks below see a positional ``cpu`` too."""
    if len(args) > len(_INIT_PARAMETERS):
        raise TypeError(f"Accelerator() takes at most {len(_INIT_PARAMETERS)} positional arguments, got {len(args)}")
    named = dict(zip(_INIT_PARAMETERS, args, strict=False))
    twice = sorted(set(named) & set(kwargs))
    if twice:
        raise TypeError(f"Accelerator() got multiple values for {twice}")
    return {**named, **kwargs}

__all__ = ["Accelerator"]


class Accelerator(accelerate.Accelerator):
    """Drop-in ``accelerate.Accelerator`` with quantized communication.

    Args:
        *args, **kwargs: as for ``accelerate.Accelerator``. ``fsdp_plugin`` may be a
            :class:`qaccel.QSDPPlugin`. ``cpu`` unset on a multi-process launch (``torchrun``,
            ``WORLD_SIZE > 1``) without a usable GPU means ``cpu=True``: the processes form one
            ``MULTI_CPU`` group over gloo (stock Accelerate would run each one alone).
        wire_meter: where collectives record their bytes (default: the process-wide meter).

    Attributes:
        qsdp: the :class:`qaccel.fsdp.QSDPHandle` once a model is prepared with a ``QSDPPlugin``, else None.
        onebit_wiring: what connects a prepared ZeroOneAdam / OneBitAdam to the prepared model and to
            checkpoints (its comm hook, its per-rank state files); ``qaccel.Trainer`` saves through it.

    Raises:
        ValueError: ``cpu=False`` on a multi-process launch without a usable GPU or other accelerator.

    Example::

        accelerator = Accelerator(fsdp_plugin=QSDPPlugin(weight_bits=8, grad_bits=8))
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        ...
        accelerator.comm_stats()["last_step"]
    """

    def __init__(self, *args: Any, wire_meter: WireMeter | None = None, **kwargs: Any) -> None:
        kwargs = _as_keywords(args, kwargs)
        kwargs = _cpu_launch.before_init(kwargs)  # first: QSDP's hook then sees the decided ``cpu``
        kwargs = _qsdp.before_init(kwargs)
        super().__init__(**kwargs)
        self.wire_meter = wire_meter if wire_meter is not None else default_meter
        self.qsdp = None  # the QSDPHandle once a model is prepared with a QSDPPlugin
        self.onebit_wiring = OneBitWiring(self)
        _qsdp.after_init(self, fsdp_plugin=kwargs.get("fsdp_plugin"))

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        _qsdp.before_prepare(self, args)
        self.onebit_wiring.before_prepare(args)
        with _qsdp.preparing(self):
            prepared = super().prepare(*args, device_placement=device_placement)
        # Accelerate returns the bare object for one argument and a list otherwise.
        objects = [prepared] if len(args) == 1 else list(prepared)
        _qsdp.after_prepare(self, objects)
        self.onebit_wiring.after_prepare(objects)
        return prepared

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **save_model_func_kwargs: Any) -> str:
        """Accelerate's ``save_state``; a 1-bit optimizer on HSDP shards is written to per-rank files only."""
        with self.onebit_wiring.state_saved_per_rank():
            return super().save_state(output_dir, safe_serialization=safe_serialization, **save_model_func_kwargs)

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **load_model_func_kwargs: Any) -> None:
        """Accelerate's ``load_state``; then a 1-bit optimizer on HSDP shards is restored from its rank file."""
        with self.onebit_wiring.state_saved_per_rank():
            super().load_state(input_dir, load_kwargs=load_kwargs, **load_model_func_kwargs)
        self.onebit_wiring.after_load_state()

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        """Accelerate's ``clip_grad_norm_``; warns once when a 1-bit optimizer would clip rank-locally."""
        self.onebit_wiring.before_clip_grad_norm()
        return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def end_training(self) -> None:
        """Finish the trackers and destroy the process group, after freeing cyclic garbage.

        Garbage still holding gloo work or communication buffers when the interpreter finalizes
        can abort the process ("terminate called without an active exception") even after the
        process group was destroyed: seen here on about a quarter of 2-process FSDP2 CPU runs
        that mix FSDP2 with a plain all-reduce (``accelerator.reduce``), none with a collection
        first (same upstream cause as pytorch/pytorch#179291 and #190489).
        """
        gc.collect()
        super().end_training()

    def comm_stats(self) -> dict:
        """Exact bytes this rank sent and received, per collective kind: totals and last step."""
        return self.wire_meter.snapshot()

    def log_comm_stats(self, step: int | None = None) -> dict:
        """Close the current step in the wire meter and log its byte counts to the trackers."""
        closed = self.wire_meter.end_step()
        values = {f"comm/{kind}/sent_bytes": tally.sent_bytes for kind, tally in closed.items()}
        values.update({f"comm/{kind}/calls": tally.calls for kind, tally in closed.items()})
        values["comm/sent_bytes"] = sum(t.sent_bytes for t in closed.values())
        self.log(values, step=step)
        return values
