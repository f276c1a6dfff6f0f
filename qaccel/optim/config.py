"""``ZeroOneAdamConfig`` and ``OneBitAdamConfig``: DeepSpeed key names and defaults, validated.

A DeepSpeed ``"optimizer": {"type": "ZeroOneAdam", "params": {...}}`` block maps one to one onto
``ZeroOneAdamConfig.from_dict(params)``. Keys DeepSpeed accepts but ignores or rejects (``bias_correction``,
``eps_inside_sqrt``, ``amsgrad``, ``max_grad_norm``, ``cuda_aware``, ``comm_backend_name``) are fields
here too, so that such a config loads, but only the value that matches what actually happens is
accepted; any other value raises (``shared/design/zero_one_adam.md`` section 9, row 8).

Precedence: explicit argument, then ``QACCEL_ZERO_ONE_ADAM_<FIELD>`` / ``QACCEL_ONEBIT_ADAM_<FIELD>``
environment variables (``from_env``), then the defaults. Only the classmethods read the environment.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from ..comm import ONEBIT_PADDINGS

__all__ = ["ZeroOneAdamConfig", "OneBitAdamConfig", "GRANULARITIES"]

GRANULARITIES = ("tensor", "group")


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
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> _OneBitConfigBase:
        """Build from ``<ENV_PREFIX><FIELD>`` variables; explicit ``overrides`` win.

        Raises:
            ValueError: for a variable under the prefix that names no field, or a value that does not parse
                or validate (the message names the variable).
        """
        environ = os.environ if environ is None else environ
        types = {f.name: f.type for f in fields(cls)}
        unknown_overrides = sorted(set(overrides) - set(types))
        if unknown_overrides:
            raise ValueError(f"{cls.__name__}.from_env: unknown arguments {unknown_overrides}")
        values: dict[str, Any] = {}
        for name, text in environ.items():
            if not name.startswith(cls.ENV_PREFIX):
                continue
            key = name[len(cls.ENV_PREFIX) :].lower()
            if key not in types:
                known = ", ".join(cls.ENV_PREFIX + k.upper() for k in types)
                raise ValueError(f"{name}: not a {cls.__name__} field; known variables: {known}")
            if key in overrides:
                continue
            try:
                values[key] = _PARSERS[str(types[key])](text)
            except ValueError as err:
                raise ValueError(f"{cls.__name__}.{key}={text!r} (from {name}): {err}") from None
        values.update(overrides)
        try:
            return cls(**values)
        except (ValueError, NotImplementedError) as err:
            env_keys = sorted(k for k in values if k not in overrides)
            if env_keys:
                raise type(err)(f"{err} (environment: {', '.join(cls.ENV_PREFIX + k.upper() for k in env_keys)})") from None
            raise


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

    Environment: ``QACCEL_ZERO_ONE_ADAM_<FIELD>`` (e.g. ``QACCEL_ZERO_ONE_ADAM_VAR_FREEZE_STEP=1000``).

    Example::

        cfg = ZeroOneAdamConfig.from_dict({"lr": 1e-3, "var_freeze_step": 1000, "local_step_scaler": 1000})
        optimizer = ZeroOneAdam(model.parameters(), config=cfg)
    """

    ENV_PREFIX: ClassVar[str] = "QACCEL_ZERO_ONE_ADAM_"

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

    Environment: ``QACCEL_ONEBIT_ADAM_<FIELD>``.
    """

    ENV_PREFIX: ClassVar[str] = "QACCEL_ONEBIT_ADAM_"

    freeze_step: int = 100000

    def __post_init__(self) -> None:
        super().__post_init__()
        if not _is_int(self.freeze_step) or self.freeze_step < 0:
            self._fail("freeze_step", self.freeze_step, "must be an int >= 0")
