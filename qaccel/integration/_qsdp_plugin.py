"""``QSDPPlugin``: Accelerate's FSDP2 plugin plus a :class:`qaccel.QSDPConfig`.

The QSDP keywords of the plugin (``weight_bits=4``, ...) are derived from ``QSDPConfig``'s fields
(:data:`QSDP_KEYWORDS`), so a new config field is a keyword here without an edit.
"""

from __future__ import annotations

import os
from dataclasses import KW_ONLY, InitVar, dataclass, field
from typing import Any

from accelerate.utils import FullyShardedDataParallelPlugin

from ..fsdp import QSDPConfig

__all__ = ["QSDPPlugin", "QSDP_KEYWORDS"]


class _NotGiven:
    """Default of the QSDP keyword shortcuts: tells "not given" apart from ``None`` ("off")."""

    def __repr__(self) -> str:
        return "<not given>"


_NOT_GIVEN: Any = _NotGiven()
#: The keyword shortcuts of :class:`QSDPPlugin`: ``QSDPConfig``'s fields, in declaration order.
QSDP_KEYWORDS: tuple[str, ...] = QSDPConfig.field_names()


def _config_keywords(cls: type) -> type:
    """Give ``cls`` one init-only keyword per :data:`QSDP_KEYWORDS` entry (default: not given), before ``@dataclass``.

    ``@dataclass`` reads a class's own annotations in order, so these come after ``recipe`` and
    reach ``__post_init__`` in the order of ``QSDP_KEYWORDS``.
    """
    for name in QSDP_KEYWORDS:
        # a string, like the other annotations of a module under `from __future__ import annotations`
        cls.__annotations__[name] = "InitVar[Any]"
        setattr(cls, name, _NOT_GIVEN)
    return cls


@dataclass
@_config_keywords
class QSDPPlugin(FullyShardedDataParallelPlugin):
    """Accelerate's FSDP2 plugin plus a :class:`qaccel.QSDPConfig`, as a dataclass like Accelerate's own.

    ``qsdp_config`` is a real field, so ``repr``, ``dataclasses.fields`` and
    ``dataclasses.replace`` keep it. The QSDP settings may be given as a ready ``qsdp_config`` or
    as keywords named after ``QSDPConfig`` fields (``weight_bits=4``, ...); keywords not given come
    from ``QACCEL_QSDP_*`` variables, then the ``qsdp`` section of the config file (``recipe`` or
    ``QACCEL_CONFIG_FILE``), then the defaults, and ``__post_init__`` turns them into ``qsdp_config``.
    All other fields are ``FullyShardedDataParallelPlugin``'s (auto-wrap, ``reshard_after_forward``,
    mixed precision, state-dict type, ...), which still read Accelerate's ``FSDP_*`` variables.
    ``fsdp_version`` defaults to 2 (``FSDP_VERSION`` if set); anything else is refused.

    Args:
        qsdp_config: a ready config (then no QSDP keyword and no recipe may be given).
        recipe: a YAML/JSON config file with a ``qsdp`` section, or a zoo recipe such as
            ``model_cards/gpt2-tiny.md`` (its ``method.qsdp``).
        weight_bits, grad_bits, ...: ``QSDPConfig`` fields (init-only; :data:`QSDP_KEYWORDS`).

    Raises:
        NotImplementedError: ``fsdp_version`` (or ``FSDP_VERSION``) is not 2.
        ValueError: a bad QSDP value (naming the key, the value and where it came from), or both
            ``qsdp_config`` and QSDP keywords / a recipe.

    Example::

        accelerator = Accelerator(fsdp_plugin=QSDPPlugin(weight_bits=8, grad_bits=8))
        accelerator = Accelerator(fsdp_plugin=QSDPPlugin(qsdp_config=QSDPConfig(grad_bits="off")))
    """

    _: KW_ONLY
    qsdp_config: QSDPConfig | None = field(default=None, metadata={"help": "the QSDP settings (qaccel.QSDPConfig)"})
    recipe: InitVar[str | os.PathLike | None] = None
    # then one InitVar per QSDPConfig field (_config_keywords)

    def __post_init__(self, recipe: str | os.PathLike | None, *qsdp_values: Any) -> None:
        given = {name: value for name, value in zip(QSDP_KEYWORDS, qsdp_values, strict=True) if value is not _NOT_GIVEN}
        if self.qsdp_config is not None:
            if given or recipe is not None:
                raise ValueError(f"QSDPPlugin: give either qsdp_config or QSDP keywords/recipe, not both (got {sorted(given)}, recipe={recipe!r})")
            if not isinstance(self.qsdp_config, QSDPConfig):
                raise TypeError(f"QSDPPlugin.qsdp_config: expected a QSDPConfig, got {type(self.qsdp_config).__name__}")
        else:
            self.qsdp_config = QSDPConfig.from_env(recipe=recipe, **given)
        version, source = self.fsdp_version, "argument"
        if version is None:
            version, source = os.environ.get("FSDP_VERSION", "2"), "FSDP_VERSION"
        if str(version) != "2":
            raise NotImplementedError(
                f"QSDPPlugin.fsdp_version={version} (from {source}): QSDP runs on FSDP2 only; use fsdp_version=2 "
                "(fsdp_config: {fsdp_version: 2} in the Accelerate config)"
            )
        self.fsdp_version = 2
        # reshard_after_forward=<int> is refused by Accelerate's FSDP2 plugin itself; install_qsdp
        # refuses it too for models sharded by hand.
        super().__post_init__()
