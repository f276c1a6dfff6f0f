"""``DiLoCoConfig``: DiLoCo's settings, one definition for the context manager, ``qaccel train`` and recipes.

``DiLoCo(accelerator, model, sync_every=..., ...)`` reads its keywords through this class, and
``qaccel train --method diloco`` reads ``--diloco_<field>`` flags, ``QACCEL_DILOCO_<FIELD>`` variables
and a recipe's ``method.diloco`` section into it (the same precedence as every qaccel config,
:mod:`qaccel._settings`).
"""

from __future__ import annotations

import math
from dataclasses import field
from typing import Any, ClassVar

from .._settings import OFF, READER, IntSetting, SettingError, SettingsMixin, TruthSetting, settings_dataclass

__all__ = ["DiLoCoConfig"]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@settings_dataclass
class DiLoCoConfig(SettingsMixin):
    """DiLoCo's outer loop (Douillard et al., arXiv 2311.08105; ``docs/diloco.md``).

    Attributes:
        sync_every: H, the inner optimizer steps between outer syncs (default 100).
        outer_lr: the outer SGD's learning rate (default 0.7, the paper's; 1.0 with momentum 0 is
            parameter averaging).
        outer_momentum: the outer SGD's Nesterov momentum, in [0, 1) (default 0.9, the paper's).
        outer_bits: the pseudo-gradient's bits on the wire, 2..8, or off for fp32 (default off).
        outer_error_feedback: with ``outer_bits``, carry what quantization dropped into the next sync
            (default true).
        seed: unsigned 64-bit seed of the outer gradients' stochastic rounding (default 0).
        fragments: F, the parts of the model (contiguous runs of parameters of about equal size) that
            sync in turn: each every ``sync_every`` steps, fragment ``f`` at step ``(f + 1) * sync_every / F``
            of the period, so one sync moves about 1/F of the model (Streaming DiLoCo, arXiv
            2501.18512); ``sync_every`` must be a multiple of F (default 1: the whole model at once).

    Environment and config file: ``QACCEL_DILOCO_<FIELD>`` and the ``diloco`` section.
    """

    ENV_PREFIX: ClassVar[str] = "QACCEL_DILOCO_"
    RECIPE_SECTION: ClassVar[str] = "diloco"

    sync_every: int = field(
        default=100, metadata={READER: IntSetting(1), "help": "H: inner optimizer steps between outer syncs, >= 1 (default 100)"}
    )
    outer_lr: float = field(default=0.7, metadata={"help": "outer SGD learning rate, a finite number > 0 (default 0.7)"})
    outer_momentum: float = field(default=0.9, metadata={"help": "outer SGD Nesterov momentum, in [0, 1); 0: plain SGD (default 0.9)"})
    outer_bits: int | None = field(
        default=None,
        metadata={READER: IntSetting(2, 8, unset=OFF), "help": "bits per pseudo-gradient value on the wire: 2..8, or off for fp32 (default off)"},
    )
    outer_error_feedback: bool = field(
        default=True, metadata={READER: TruthSetting(), "help": "with outer_bits: error feedback across syncs (default true)"}
    )
    seed: int = field(
        default=0, metadata={READER: IntSetting(0, (1 << 64) - 1, base=0), "help": "unsigned 64-bit seed of the outer rounding noise (default 0)"}
    )
    fragments: int = field(
        default=1,
        metadata={READER: IntSetting(1), "help": "F: parts of the model that sync in turn, each every sync_every steps, staggered by "
                                                "sync_every/F (Streaming DiLoCo); sync_every must be a multiple (default 1)"},
    )

    def __post_init__(self) -> None:
        if not _is_number(self.outer_lr) or not math.isfinite(self.outer_lr) or self.outer_lr <= 0:
            raise SettingError("outer_lr", self.outer_lr, "must be a finite number > 0 (the paper uses 0.7)", owner="DiLoCoConfig")
        if not _is_number(self.outer_momentum) or not 0 <= self.outer_momentum < 1:
            raise SettingError("outer_momentum", self.outer_momentum, "must be a number in [0, 1) (the paper uses 0.9)", owner="DiLoCoConfig")
        if self.sync_every % self.fragments:
            raise SettingError(
                "fragments", self.fragments, f"must divide sync_every={self.sync_every} (fragments sync every sync_every/fragments steps in turn)",
                owner="DiLoCoConfig",
            )  # fmt: skip
