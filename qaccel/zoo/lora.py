"""LoRA fine-tuning (``peft``): the recipe's ``lora:`` section, the ``--lora_*`` flags, and the wrap.

A run with LoRA wraps the loaded model with ``peft.get_peft_model`` before ``accelerator.prepare``,
as a user's own script would: the base weights are frozen and only the low-rank adapters (and, for
sequence classification, the new head: peft's ``task_type=SEQ_CLS`` keeps ``classifier``/``score``
trainable through ``modules_to_save``) receive gradients. Under FSDP2 the all-gather of the frozen
base weights is then almost all the traffic, which QSDP's weight path cuts; the reduce-scatter
carries the trainable parameters only (:mod:`qaccel.fsdp`, "frozen parameters").

Keys and flags carry peft's ``LoraConfig`` names: ``r`` (``--lora_r``), ``lora_alpha``,
``lora_dropout`` and ``target_modules`` (``--lora_target_modules``; module name suffixes, as peft
matches them; default: peft's list for the model type, e.g. ``query, value`` for BERT). Every value
is checked before any process starts, target names against the model's own modules (built on the
meta device, no weights).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from ._schema import Key, check_section

__all__ = [
    "LORA_KEYS", "LoraSpec", "add_lora_flags", "apply_lora", "check_lora_resume", "check_lora_targets", "check_recipe_lora", "lora_from_flags",
    "parse_lora",
]  # fmt: skip

# peft's LoraConfig defaults (peft 0.13 - 0.21), so a section or flag left out means what peft means.
_PEFT_ALPHA, _PEFT_DROPOUT = 8, 0.0
# qaccel task -> peft TaskType; masked-LM has none (its head is tied to the frozen embeddings).
_PEFT_TASK_TYPES = {"causal-lm": "CAUSAL_LM", "sequence-classification": "SEQ_CLS", "masked-lm": None}
# Layer types peft's LoRA can adapt (peft/tuners/lora/model.py, _create_new_module); containers cannot be targets.
_ADAPTABLE = ("Linear", "Conv1D", "Embedding", "Conv1d", "Conv2d", "Conv3d")

LORA_KEYS = [
    Key("r", "int", minimum=1),
    Key("lora_alpha", "int", default=_PEFT_ALPHA, minimum=1),
    Key("lora_dropout", "float", default=_PEFT_DROPOUT, minimum=0.0, maximum=1.0, below=True),
    Key("target_modules", "list[str]", default=None, nullable=True),
]


@dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """What the ``lora:`` section and the ``--lora_*`` flags set (peft ``LoraConfig`` names).

    Attributes:
        r: the adapters' rank, >= 1.
        lora_alpha: the scale numerator (updates are scaled by ``lora_alpha / r``), >= 1; default 8 (peft's).
        lora_dropout: dropout on the adapters' input, in [0, 1); default 0.0.
        target_modules: module name suffixes to adapt, or ``None`` for peft's default of the model type.
    """

    r: int
    lora_alpha: int = _PEFT_ALPHA
    lora_dropout: float = _PEFT_DROPOUT
    target_modules: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        check_section("LoraSpec", "lora", self.to_dict(), LORA_KEYS)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; ``LoraSpec(**d)`` rebuilds it (a list of targets reads back as a tuple)."""
        data = dataclasses.asdict(self)
        data["target_modules"] = list(self.target_modules) if self.target_modules is not None else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "lora") -> LoraSpec:
        """Check ``data`` as a ``lora:`` section (ValueError naming the key) and build the spec."""
        return cls(**check_section(where, "lora", data, LORA_KEYS))


def parse_lora(where: str, section: Any) -> LoraSpec | None:
    """A recipe's ``lora:`` section (``None``: no LoRA) as a :class:`LoraSpec`; ValueError naming the key."""
    return None if section is None else LoraSpec.from_dict(section, where)


def add_lora_flags(parser: argparse.ArgumentParser) -> None:
    """``--lora_r``, ``--lora_alpha``, ``--lora_dropout``, ``--lora_target_modules`` (not given: ``None``)."""
    group = parser.add_argument_group("LoRA (peft; the recipe's lora: section, these on top)")
    group.add_argument("--lora_r", type=int, help="fine-tune low-rank adapters of this rank (>= 1) instead of every weight")
    group.add_argument("--lora_alpha", type=int, help=f"LoRA scale numerator: updates are scaled by alpha / r (default {_PEFT_ALPHA}, peft's)")
    group.add_argument("--lora_dropout", type=float, help="dropout on the adapters' input, in [0, 1) (default 0)")
    group.add_argument("--lora_target_modules", nargs="+", metavar="NAME",
                       help="module names to adapt, as in peft's LoraConfig (e.g. query value; default: peft's for the model type)")  # fmt: skip


def lora_from_flags(args: argparse.Namespace, recipe_lora: LoraSpec | None) -> LoraSpec | None:
    """The run's LoRA settings: the recipe's ``lora:`` section with the flags given on top.

    Raises:
        ValueError: a flag out of range, or a ``--lora_*`` flag without ``--lora_r`` on a recipe
            without a ``lora:`` section.
    """
    names = {"r": "lora_r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout", "target_modules": "lora_target_modules"}
    given = {key: getattr(args, flag, None) for key, flag in names.items() if getattr(args, flag, None) is not None}
    if "target_modules" in given:  # `--lora_target_modules query,value` reads like `query value`
        given["target_modules"] = [name for item in given["target_modules"] for name in item.split(",") if name]
    if not given:
        return recipe_lora
    if recipe_lora is None and "r" not in given:
        raise ValueError(f"--{names[next(iter(given))]}: needs --lora_r (the adapters' rank) or a recipe with a lora: section")
    settings = {} if recipe_lora is None else recipe_lora.to_dict()
    where = "--lora_* flags"
    checked = check_section(where, "lora", {**settings, **given}, LORA_KEYS)
    return LoraSpec(**checked)


def _adaptable_names(model: Any) -> dict[str, str]:
    """``{qualified module name: type name}`` of the layers LoRA can adapt."""
    return {name: type(module).__name__ for name, module in model.named_modules() if name and type(module).__name__ in _ADAPTABLE}


def _default_targets(model_type: str) -> list[str] | None:
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
    return list(targets) if targets is not None else None


def check_lora_targets(model: Any, spec: LoraSpec, source: str) -> list[str]:
    """The target names ``spec`` resolves to for ``model``; ValueError when one matches no adaptable layer.

    Names match as peft matches a list: a module whose qualified name equals the name or ends with
    ``.<name>``. ``model`` may live on the meta device.

    Raises:
        ValueError: an unknown name (listing the adaptable names of the model), or no
            ``target_modules`` for a model type peft has no default for.
    """
    layers = _adaptable_names(model)
    suffixes = sorted({name.rsplit(".", 1)[-1] for name in layers})
    targets = list(spec.target_modules) if spec.target_modules is not None else _default_targets(model.config.model_type)
    if targets is None:
        raise ValueError(
            f"lora.target_modules: peft has no default for model type {model.config.model_type!r} ({source}); "
            f"name them (--lora_target_modules), from: {', '.join(suffixes)}"
        )
    unknown = [t for t in targets if not any(name == t or name.endswith("." + t) for name in layers)]
    if unknown:
        raise ValueError(f"lora.target_modules={unknown}: no such layer in {source}; LoRA can adapt: {', '.join(suffixes)}")
    return targets


def check_recipe_lora(spec: LoraSpec, recipe: Any, name_or_path: str | None) -> list[str]:
    """Check ``spec`` against the run's model before anything trains: built on the meta device, no weights.

    Returns:
        The resolved target names.

    Raises:
        MissingExtraError: peft is not installed.
        ValueError: a target that matches no layer (see :func:`check_lora_targets`).
        RuntimeError: the model config cannot be loaded (offline Hub id).
    """
    import torch
    import transformers

    from .._extras import require_extra
    from .models import TASK_AUTO_CLASSES, hub_load_error, resolve_model_path

    require_extra("lora", "LoRA fine-tuning (--lora_r or a recipe's lora: section)")
    if name_or_path is None:
        values = dict(recipe.model.config)
        config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
        source = f"the {config.model_type} config of recipe {recipe.name!r}"
    else:
        try:
            config = transformers.AutoConfig.from_pretrained(resolve_model_path(name_or_path))
        except OSError as err:
            raise hub_load_error(name_or_path, "model config", err) from err
        source = repr(name_or_path)
    with torch.device("meta"):
        model = getattr(transformers, TASK_AUTO_CLASSES[recipe.task]).from_config(config)
    return check_lora_targets(model, spec, source)


def apply_lora(model: Any, spec: LoraSpec, task: str, *, seed: int = 0) -> Any:
    """Wrap ``model`` with ``peft.get_peft_model`` for ``spec`` (call before ``accelerator.prepare``).

    The base weights are frozen; the adapters (and a classifier head, through peft's ``SEQ_CLS``
    task type) train. The adapters are initialised from a private generator state seeded with
    ``seed`` (the caller's RNG is untouched, as in ``load_model``), so every process builds the same
    ones without a broadcast, whatever it drew before.

    Raises:
        MissingExtraError: peft is not installed (the ``lora`` extra).
        ValueError: a target that matches no layer of the model.
    """
    from .._extras import require_extra

    require_extra("lora", "LoRA fine-tuning")
    import torch
    from peft import LoraConfig, get_peft_model

    targets = check_lora_targets(model, spec, type(model).__name__)
    config = LoraConfig(
        r=spec.r,
        lora_alpha=spec.lora_alpha,
        lora_dropout=spec.lora_dropout,
        target_modules=targets,
        task_type=_PEFT_TASK_TYPES[task],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def check_lora_resume(saved_run_state: dict, spec: LoraSpec | None) -> None:
    """Refuse to resume a checkpoint with other LoRA settings (its weights would not fit the model).

    Raises:
        ValueError: naming both settings (``None``: trained without LoRA).
    """
    saved = (saved_run_state.get("extra") or {}).get("lora")
    current = spec.to_dict() if spec is not None else None
    if saved != current:
        raise ValueError(
            f"resume: lora differs: checkpoint {saved!r}, this run {current!r}; resume with the checkpoint's LoRA settings "
            "(the recipe's lora: section and --lora_* flags)"
        )
