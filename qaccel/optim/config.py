"""``ZeroOneAdamConfig`` and ``OneBitAdamConfig``: DeepSpeed key names and defaults, validated.

A DeepSpeed ``"optimizer": {"type": "ZeroOneAdam", "params": {...}}`` block maps one to one onto
``ZeroOneAdamConfig.from_dict(params)``. Keys DeepSpeed accepts but ignores or rejects (``bias_correction``,
``eps_inside_sqrt``, ``amsgrad``, ``max_grad_norm``, ``cuda_aware``, ``comm_backend_name``) are fields
here too, so that such a config loads, but only the value that matches what actually happens is
accepted; any other value raises (``docs/zero_one_adam.md``, "DeepSpeed compatibility keys").

Precedence, the same as QSDP's: explicit argument, then ``QACCEL_ZERO_ONE_ADAM_<FIELD>`` /
``QACCEL_ONEBIT_ADAM_<FIELD>`` environment variables, then the ``zero_one_adam`` / ``onebit_adam`` section
of a recipe file (``QACCEL_RECIPE`` or the ``recipe`` argument), then the defaults. Only the classmethods
(``from_env``, ``resolve``) read the environment or files; ``ZeroOneAdamConfig(...)`` itself is pure.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

from ..comm import ONEBIT_PADDINGS

__all__ = ["ZeroOneAdamConfig", "OneBitAdamConfig", "GRANULARITIES", "RECIPE_ENV"]

GRANULARITIES = ("tensor", "group")
RECIPE_ENV = "QACCEL_RECIPE"
"""Names a recipe file (YAML or JSON) whose ``zero_one_adam`` / ``onebit_adam`` section gives settings."""


def _parse_bool(text: str) -> bool:
    words = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
    if text.strip().lower() not in words:
        raise ValueError(f"{text!r} is not a boolean (use 1/0/true/false/yes/no)")
    return words[text.strip().lower()]


def _parse_betas(text: str) -> tuple[float, float]:
    parts = [part for part in text.replace("(", "").replace(")", "").split(",") if part.strip()]
    if len(parts) != 2:
        raise ValueError(f"{text!r} is not two comma-separated floats, e.g. '0.9,0.999'")
    return float(parts[0]), float(parts[1])


_PARSERS: dict[str, Callable[[str], Any]] = {
    "float": float,
    "int": int,
    "bool": _parse_bool,
    "str": str,
    "tuple[float, float]": _parse_betas,
}


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class _OneBitConfigBase:
    """Fields shared by both optimizers; see the subclasses for the documentation."""

    ENV_PREFIX: ClassVar[str] = ""
    RECIPE_SECTION: ClassVar[str] = ""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    granularity: str = "tensor"
    padding: str = "deepspeed"
    gradient_clipping: float = 0.0
    replica_check_interval: int = 0
    bias_correction: bool = False
    eps_inside_sqrt: bool = False
    amsgrad: bool = False
    max_grad_norm: float = 0.0
    cuda_aware: bool = False
    comm_backend_name: str = "nccl"

    def _fail(self, key: str, value: object, allowed: str, error: type[Exception] = ValueError) -> None:
        raise error(f"{type(self).__name__}.{key}={value!r}: {allowed}")

    def __post_init__(self) -> None:
        if not _is_number(self.lr) or self.lr < 0:
            self._fail("lr", self.lr, "must be a number >= 0")
        if (
            not isinstance(self.betas, tuple)
            or len(self.betas) != 2
            or not all(_is_number(b) and 0.0 <= b < 1.0 for b in self.betas)
        ):
            self._fail("betas", self.betas, "must be a tuple of two numbers in [0, 1)")
        if not _is_number(self.eps) or self.eps <= 0:
            self._fail("eps", self.eps, "must be a number > 0 (added outside the square root)")
        if not _is_number(self.weight_decay) or self.weight_decay < 0:
            self._fail("weight_decay", self.weight_decay, "must be a number >= 0 (decoupled decay)")
        if self.granularity not in GRANULARITIES:
            self._fail("granularity", self.granularity, f"must be one of {', '.join(GRANULARITIES)}")
        if self.padding not in ONEBIT_PADDINGS:
            self._fail("padding", self.padding, f"must be one of {', '.join(ONEBIT_PADDINGS)}")
        if not _is_number(self.gradient_clipping) or self.gradient_clipping < 0:
            self._fail("gradient_clipping", self.gradient_clipping, "must be a number >= 0 (0 disables clipping)")
        if not _is_int(self.replica_check_interval) or self.replica_check_interval < 0:
            self._fail("replica_check_interval", self.replica_check_interval, "must be an int >= 0 (0 disables the check)")
        # DeepSpeed keys that DeepSpeed itself ignores or rejects: accept only the value that is true.
        if self.bias_correction is not False:
            self._fail(
                "bias_correction",
                self.bias_correction,
                "must be False: this optimizer applies no bias correction (DeepSpeed accepts the key and ignores it)",
            )
        if self.eps_inside_sqrt is not False:
            self._fail("eps_inside_sqrt", self.eps_inside_sqrt, "must be False: eps is always added outside the sqrt")
        if self.amsgrad is not False:
            self._fail("amsgrad", self.amsgrad, "must be False: AMSGrad is not supported", NotImplementedError)
        if not _is_number(self.max_grad_norm) or self.max_grad_norm != 0:
            self._fail("max_grad_norm", self.max_grad_norm, "must be 0: use gradient_clipping (DeepSpeed rejects it too)")
        if self.cuda_aware is not False:
            self._fail("cuda_aware", self.cuda_aware, "must be False: it only concerns DeepSpeed's MPI backend")
        if self.comm_backend_name != "nccl":
            self._fail(
                "comm_backend_name",
                self.comm_backend_name,
                "must be 'nccl': qaccel always communicates through the torch.distributed process group it is "
                "given (NCCL on GPU, gloo on CPU); DeepSpeed's mpi/hccl/compressed backends do not exist here",
                NotImplementedError,
            )

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> _OneBitConfigBase:
        """Build from a mapping with DeepSpeed key names (e.g. a DeepSpeed JSON ``params`` block).

        Raises:
            ValueError: for an unknown key (listing the known ones) or an invalid value.
        """
        known = cls.field_names()
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"{cls.__name__}.from_dict: unknown keys {unknown}; known keys: {', '.join(known)}")
        values = dict(data)
        if isinstance(values.get("betas"), list):
            values["betas"] = tuple(values["betas"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict that ``from_dict`` turns back into an equal config."""
        data = asdict(self)
        data["betas"] = list(self.betas)
        return data

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        recipe: str | os.PathLike | Mapping[str, Any] | None = None,
        **overrides: Any,
    ) -> _OneBitConfigBase:
        """Explicit ``overrides``, then ``<ENV_PREFIX><FIELD>`` variables, then a recipe, then the defaults.

        Args:
            environ: the environment to read (default ``os.environ``).
            recipe: a YAML/JSON file whose ``RECIPE_SECTION`` section (``zero_one_adam`` or ``onebit_adam``)
                holds settings, or that section as a mapping; default: the file named by ``QACCEL_RECIPE``,
                if set. A file without the section contributes nothing.
            **overrides: field values given in code.

        Raises:
            ValueError: for a variable under the prefix or a recipe key that names no field, or a value that
                does not parse or validate (the message names the variable or the recipe).
        """
        environ = os.environ if environ is None else environ
        types = {f.name: f.type for f in fields(cls)}
        unknown_overrides = sorted(set(overrides) - set(types))
        if unknown_overrides:
            raise ValueError(f"{cls.__name__}.from_env: unknown arguments {unknown_overrides}")
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        if recipe is None and environ.get(RECIPE_ENV):
            recipe = environ[RECIPE_ENV]
        if recipe is not None:
            section, where = cls._recipe_section(recipe)
            unknown = sorted(set(section) - set(types))
            if unknown:
                raise ValueError(f"{cls.__name__}: unknown keys {unknown} (from {where}); known keys: {', '.join(types)}")
            values.update(section)
            if isinstance(values.get("betas"), list):
                values["betas"] = tuple(values["betas"])
            sources.update({key: where for key in section})
        for name, text in environ.items():
            if not name.startswith(cls.ENV_PREFIX):
                continue
            key = name[len(cls.ENV_PREFIX) :].lower()
            if key not in types:
                known = ", ".join(cls.ENV_PREFIX + k.upper() for k in types)
                raise ValueError(f"{name}: not a {cls.__name__} field; known variables: {known}")
            try:
                values[key] = _PARSERS[str(types[key])](text)
            except ValueError as err:
                raise ValueError(f"{cls.__name__}.{key}={text!r} (from {name}): {err}") from None
            sources[key] = name
        values.update(overrides)
        for key in overrides:
            sources.pop(key, None)
        try:
            return cls(**values)
        except (ValueError, NotImplementedError, TypeError) as err:
            if sources:
                where = "; ".join(f"{key} from {source}" for key, source in sorted(sources.items()))
                raise type(err)(f"{err} (settings not given as arguments: {where})") from None
            raise

    @classmethod
    def _recipe_section(cls, recipe: str | os.PathLike | Mapping[str, Any]) -> tuple[dict[str, Any], str]:
        """(settings, description of where they came from) of the recipe's ``RECIPE_SECTION``."""
        if isinstance(recipe, Mapping):
            return dict(recipe), f"recipe {cls.RECIPE_SECTION} mapping"
        path = Path(recipe)
        if not path.is_file():
            raise ValueError(f"{cls.__name__} recipe {str(path)!r}: no such file")
        text = path.read_text(encoding="utf-8")
        import yaml

        try:
            data = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
        except (ValueError, yaml.YAMLError) as err:
            raise ValueError(f"{cls.__name__} recipe {str(path)!r}: not valid JSON/YAML ({err})") from None
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ValueError(f"{cls.__name__} recipe {str(path)!r}: must be a mapping of sections")
        section = data.get(cls.RECIPE_SECTION) or {}
        if not isinstance(section, Mapping):
            raise ValueError(
                f"{cls.__name__} recipe {str(path)!r}: the {cls.RECIPE_SECTION!r} section must be a mapping of "
                f"{cls.__name__} fields, got {type(section).__name__}"
            )
        return dict(section), f"recipe {path}"

    @classmethod
    def resolve(
        cls,
        config: _OneBitConfigBase | None = None,
        arguments: Mapping[str, Any] | None = None,
        *,
        recipe: str | os.PathLike | Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> _OneBitConfigBase:
        """The optimizers' config: ``config`` as given (with ``arguments`` replacing fields), or, without a
        config, ``arguments`` over the environment over the recipe over the defaults (:meth:`from_env`).

        Raises:
            TypeError: an argument names no field, or ``config`` is not a ``cls``, or both ``config`` and
                ``recipe`` are given (a config object is complete; build it with ``from_env(recipe=...)``).
        """
        arguments = dict(arguments or {})
        known = cls.field_names()
        unknown = sorted(set(arguments) - set(known))
        if unknown:
            raise TypeError(f"{cls.__name__}: unknown arguments {unknown}; known: {', '.join(known)}")
        if config is None:
            return cls.from_env(environ, recipe=recipe, **arguments)
        if not isinstance(config, cls):
            raise TypeError(f"config must be a {cls.__name__}, got {type(config).__name__}")
        if recipe is not None:
            raise TypeError(f"{cls.__name__}: give config or recipe, not both (a config object is used as given)")
        return dataclasses.replace(config, **arguments) if arguments else config


@dataclass(frozen=True, kw_only=True)
class ZeroOneAdamConfig(_OneBitConfigBase):
    """Settings of 0/1 Adam (Lu et al. 2022), DeepSpeed ``ZeroOneAdam`` key names and defaults.

    Attributes:
        lr: learning rate, >= 0 (default 1e-3); per-group ``lr`` overrides it. Also summed into the
            local-step momentum reconstruction.
        betas: ``(beta1, beta2)`` in [0, 1) (default (0.9, 0.999)).
        eps: > 0, added outside the square root (default 1e-8).
        weight_decay: decoupled decay inside the update direction, >= 0 (default 0). As in DeepSpeed it
            also leaks into the momentum rebuilt at a sync.
        var_freeze_step: F, the last step allowed to update the variance (default 100000; usually the end
            of LR warm-up). Steps 2..F+1 are phase 1, later steps phase 2 (local steps).
        var_update_scaler: kappa, variance updates per interval before the interval doubles (default 16).
        local_step_scaler: alpha, phase-2 steps between doublings of the sync interval (default 32678, sic,
            DeepSpeed's default; the tutorial uses 1000 for short runs).
        local_step_clipper: H, the largest sync interval (default 16).
        granularity: what one compressed all-reduce covers: ``"tensor"`` (each parameter, DeepSpeed's fp32
            numerics; default) or ``"group"`` (one flat buffer per param group, DeepSpeed's fp16 numerics:
            one scale per group, less padding). Either way a step issues one all-to-all and one all-gather.
        padding: ``"deepspeed"`` (pad to a multiple of N*lcm(N, 8), numeric parity; default) or
            ``"minimal"`` (multiple of 8N).
        gradient_clipping: max global L2 norm of the gradient, 0 disables (DeepSpeed's engine key; default
            0). See the README for which norm is used on which step.
        replica_check_interval: every this many optimizer steps (0: never; default 0) all ranks all-gather a
            checksum of the schedule counters, the variance and the synced weights (also the weights at a
            synced point) and raise if any rank differs. A debugging aid: one small all-gather per check.
        bias_correction, eps_inside_sqrt, amsgrad, max_grad_norm, cuda_aware, comm_backend_name:
            DeepSpeed compatibility keys; only False / False / False / 0 / False / "nccl" are accepted.

    Environment and recipe: ``QACCEL_ZERO_ONE_ADAM_<FIELD>`` (e.g. ``QACCEL_ZERO_ONE_ADAM_VAR_FREEZE_STEP=1000``)
    and the ``zero_one_adam`` section of the recipe named by ``QACCEL_RECIPE``; see :meth:`from_env`.
    ``ZeroOneAdam(params, lr=...)`` without a config reads both (argument > environment > recipe > default).

    Example::

        cfg = ZeroOneAdamConfig.from_dict({"lr": 1e-3, "var_freeze_step": 1000, "local_step_scaler": 1000})
        optimizer = ZeroOneAdam(model.parameters(), config=cfg)
    """

    ENV_PREFIX: ClassVar[str] = "QACCEL_ZERO_ONE_ADAM_"
    RECIPE_SECTION: ClassVar[str] = "zero_one_adam"

    var_freeze_step: int = 100000
    var_update_scaler: int = 16
    local_step_scaler: int = 32678
    local_step_clipper: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        if not _is_int(self.var_freeze_step) or self.var_freeze_step < 0:
            self._fail("var_freeze_step", self.var_freeze_step, "must be an int >= 0")
        for key in ("var_update_scaler", "local_step_scaler", "local_step_clipper"):
            value = getattr(self, key)
            if not _is_int(value) or value < 1:
                self._fail(key, value, "must be an int >= 1")


@dataclass(frozen=True, kw_only=True)
class OneBitAdamConfig(_OneBitConfigBase):
    """Settings of 1-bit Adam (Tang et al. 2021), DeepSpeed ``OneBitAdam`` key names and defaults.

    Attributes:
        freeze_step: steps 2..max(freeze_step, 2) are full Adam with all-reduced gradients; later steps
            freeze the variance and send the momentum through the 1-bit all-reduce (default 100000; the
            DeepSpeed tutorial suggests 15-25% of the run).
        lr, betas, eps, weight_decay, granularity, padding, gradient_clipping, replica_check_interval and
            the compatibility keys: as in :class:`ZeroOneAdamConfig`.

    Environment and recipe: ``QACCEL_ONEBIT_ADAM_<FIELD>`` and the ``onebit_adam`` recipe section.
    """

    ENV_PREFIX: ClassVar[str] = "QACCEL_ONEBIT_ADAM_"
    RECIPE_SECTION: ClassVar[str] = "onebit_adam"

    freeze_step: int = 100000

    def __post_init__(self) -> None:
        super().__post_init__()
        if not _is_int(self.freeze_step) or self.freeze_step < 0:
            self._fail("freeze_step", self.freeze_step, "must be an int >= 0")
