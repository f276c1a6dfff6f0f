"""Install QSDP comms on every FSDP2 unit of a model, and the optimizer step post-hook.

``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter`` set one unit only (they do
not recurse), so the installer walks ``model.modules()``. Units whose gradients are quantized get
``set_force_sum_reduction_for_comms(True)`` and ``set_gradient_divide_factor(1.0)``: FSDP then adds
no scaling and the comm divides the fp32 sum once (``shared/design/qsdp.md`` 5.3). Units left on
the stock path keep FSDP's reduce op and divide factor untouched, so they stay bit-identical.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..comm import WireMeter, default_meter
from ._comms import QuantizedAllGather, QuantizedReduceScatter, UnitPlan
from ._master import requantize_shards
from ._seeds import SeedSchedule
from ._units import FSDPUnit, find_units, require_custom_comms
from .config import QSDPConfig

__all__ = ["QSDPHandle", "install_qsdp"]

logger = logging.getLogger(__name__)


@dataclass
class QSDPHandle:
    """What :func:`install_qsdp` installed: units, their plans and comms, and the seed schedule.

    ``state_dict()`` / ``load_state_dict()`` carry the step counter (and check the seed and world
    size), so a resumed run draws the same rounding noise as an uninterrupted one.
    """

    config: QSDPConfig
    units: list[FSDPUnit]
    plans: list[UnitPlan]
    all_gathers: list[QuantizedAllGather]
    reduce_scatters: list[QuantizedReduceScatter]
    seeds: SeedSchedule
    world_size: int
    _hooks: list = field(default_factory=list)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Advance the seeds (and re-round mode-B shards) after each step of ``optimizer``."""
        self._hooks.append(optimizer.register_step_post_hook(lambda *_: self.after_optimizer_step()))

    def after_optimizer_step(self) -> None:
        """Mode ``quantized``: put every quantized unit's shard on its grid; then advance the step."""
        codec = self.config.weight_codec()
        if self.config.master_weights == "quantized" and codec is not None:
            for unit, plan in zip(self.units, self.plans, strict=True):
                if plan.enabled and unit.params:
                    rank = unit.params[0].device_mesh.get_local_rank()
                    requantize_shards(unit, plan, codec, self.seeds.master_seed(unit.index, rank))
        self.seeds.advance()

    def describe(self) -> list[dict]:
        """Per unit: name, shard elements, quantized elements, and which paths are quantized."""
        return [
            {
                "unit": plan.name,
                "shard_numel": sum(n for n, _ in plan.segments),
                "quantized_numel": sum(n for n, q in plan.segments if q),
                "weights_quantized": ag.codec is not None,
                "grads_quantized": rs.codec is not None,
            }
            for plan, ag, rs in zip(self.plans, self.all_gathers, self.reduce_scatters, strict=True)
        ]

    def state_dict(self) -> dict:
        return {"seeds": self.seeds.state_dict(), "world_size": self.world_size, "config": self.config.to_dict()}

    def load_state_dict(self, state: dict) -> None:
        if int(state["world_size"]) != self.world_size:
            raise ValueError(f"QSDP checkpoint: saved with world_size={state['world_size']}, resuming with {self.world_size}")
        self.seeds.load_state_dict(state["seeds"])

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def install_qsdp(
    model: nn.Module,
    config: QSDPConfig,
    *,
    optimizers: Iterable[torch.optim.Optimizer] = (),
    meter: WireMeter | None = None,
) -> QSDPHandle:
    """Give every FSDP2 unit of ``model`` a QSDP all-gather and reduce-scatter.

    Call after ``fully_shard`` (or ``accelerator.prepare``) and before the first forward. Every
    check runs before any collective.

    Args:
        model: a model whose units were sharded with ``fully_shard`` on a 1-D mesh.
        config: the QSDP settings.
        optimizers: optimizers whose steps advance the seeds (and re-round mode-B shards).
        meter: where bytes are recorded (default: the process-wide meter).

    Returns:
        A :class:`QSDPHandle`.

    Raises:
        RuntimeError: torch without FSDP2 custom comms.
        ValueError: ``model`` has no FSDP2 unit, or a unit already has another custom comm.
        NotImplementedError: HSDP / 2-D mesh, or several param groups in a unit.

    Example::

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        handle = install_qsdp(model, QSDPConfig(weight_bits=8, grad_bits=8), optimizers=[opt])
    """
    require_custom_comms()
    if not isinstance(config, QSDPConfig):
        raise TypeError(f"install_qsdp: config must be a QSDPConfig, got {type(config).__name__}")
    units = find_units(model)
    if not units:
        raise ValueError(f"install_qsdp: {type(model).__name__} has no FSDP2 unit; call fully_shard (or accelerator.prepare with an FSDP2 plugin) first")
    meter = default_meter if meter is None else meter
    seeds = SeedSchedule(config.seed)
    world_size = max(unit.world_size for unit in units)
    plans, all_gathers, reduce_scatters = [], [], []
    for unit in units:
        plan = UnitPlan.build(
            unit.index,
            unit.name,
            [p.shape for p in unit.params],
            unit.shard_numels(),
            param_min_numel=config.param_min_numel,
            unit_min_numel=config.unit_min_numel,
        )
        all_gather = QuantizedAllGather(plan, config.weight_codec(), seeds, meter)
        reduce_scatter = QuantizedReduceScatter(plan, config.grad_codec(), seeds, meter)
        for module in unit.modules:
            if reduce_scatter.owns_averaging:
                module.set_force_sum_reduction_for_comms(True)
                module.set_gradient_divide_factor(1.0)
            module.set_custom_all_gather(all_gather)
            module.set_custom_reduce_scatter(reduce_scatter)
        plans.append(plan)
        all_gathers.append(all_gather)
        reduce_scatters.append(reduce_scatter)
    handle = QSDPHandle(config, units, plans, all_gathers, reduce_scatters, seeds, world_size)
    for optimizer in optimizers:
        handle.attach_optimizer(optimizer)
    logger.debug("QSDP installed on %d FSDP units: %s", len(units), handle.describe())
    return handle
