"""``ZeroOneAdamConfig`` and ``OneBitAdamConfig``: DeepSpeed key names and defaults, validated.

A DeepSpeed ``"optimizer": {"type": "ZeroOneAdam", "params": {...}}`` block maps one to one onto
``ZeroOneAdamConfig.from_dict(params)``. Keys DeepSpeed accepts but ignores or rejects (``bias_correction``,
``eps_inside_sqrt``, ``amsgrad``, ``max_grad_norm``, ``cuda_aware``, ``comm_backend_name``) are fields
here too, so that such a config loads, but only the value that matches what actually happens is
accepted; any other value raises (``docs/zero_one_adam.md``, "DeepSpeed compatibility keys").

Precedence, the same as QSDP's: explicit argument, then ``QACCEL_ZERO_ONE_ADAM_<FIELD>`` /
``QACCEL_ONEBIT_ADAM_<FIELD>`` environment variables, then the ``zero_one_adam`` / ``onebit_adam`` section
of a config file (``QACCEL_CONFIG_FILE`` or the ``recipe`` argument; a zoo recipe such as
``model_cards/bert-tiny.md`` works too, its ``method.zero_one_adam``), then the defaults. Only the
classmethods (``from_env``, ``resolve``) read the environment or files, through the one settings reader,
:mod:`qaccel._settings`; ``ZeroOneAdamConfig(...)`` itself is pure.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .._settings import (
    DEPRECATED_CONFIG_FILE_ENV,
    SettingError,
    SettingProblem,
    SettingsMixin,
    SettingTypeError,
    UnsupportedSetting,
)
from ..comm import ONEBIT_PADDINGS

__all__ = ["OneBitConfigBase", "ZeroOneAdamConfig", "OneBitAdamConfig", "GRANULARITIES", "RECIPE_ENV"]

GRANULARITIES = ("tensor", "group")
RECIPE_ENV = DEPRECATED_CONFIG_FILE_ENV
"""Deprecated name of the variable that names a config file; use ``QACCEL_CONFIG_FILE`` (``qaccel._settings``)."""


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class OneBitConfigBase(SettingsMixin):
    """Fields shared by both 1-bit optimizers' configs; see the subclasses for the documentation.

    Public so that code which accepts either config (the optimizers' shared base,
    :class:`qaccel.optim.OneBitOptimizerBase`) can name the type.
    """

    lr: float = field(default=1e-3, metadata={"help": "learning rate, >= 0; a param group's lr overrides it (default 1e-3)"})
    betas: tuple[float, float] = field(default=(0.9, 0.999), metadata={"help": "beta1,beta2, each in [0, 1) (default 0.9,0.999)"})
    eps: float = field(default=1e-8, metadata={"help": "> 0, added outside the square root (default 1e-8)"})
    weight_decay: float = field(default=0.0, metadata={"help": "decoupled weight decay inside the update, >= 0 (default 0)"})
    granularity: str = field(
        default="tensor",
        metadata={"help": "what one compressed all-reduce covers: tensor (each parameter; default) or group (one flat buffer per param group)"},
    )
    padding: str = field(
        default="deepspeed", metadata={"help": "deepspeed (pad to N*lcm(N, 8), numeric parity; default) or minimal (multiple of 8N)"}
    )
    gradient_clipping: float = field(default=0.0, metadata={"help": "max global L2 norm of the gradient; 0 disables (default 0)"})
    replica_check_interval: int = field(
        default=0, metadata={"help": "every N optimizer steps, check that all replicas agree (one small all-gather); 0: never (default)"}
    )
    overlap_comm: bool = field(
        default=True,
        metadata={
            "help": "start each DDP bucket's 1-bit all-reduce during backward (CPU/gloo; same results bit for bit); "
            "inactive with gradient_clipping, an fp16 GradScaler or accelerator.clip_grad_norm_ (default true)"
        },
    )
    variance_bias_correction: bool = field(
        default=False,
        metadata={
            "help": "divide the variance by 1 - beta2^k (k: the variance updates it holds) wherever a step uses it, as Adam "
            "does, so that a variance frozen after few updates does not make every later step up to 1/sqrt(1 - beta2^k) "
            "times Adam's; the momentum stays uncorrected; false: DeepSpeed's numerics (default false)"
        },
    )
    bias_correction: bool = field(
        default=False, metadata={"help": "DeepSpeed compatibility key; only false (see variance_bias_correction for qaccel's own)"}
    )
    eps_inside_sqrt: bool = field(default=False, metadata={"help": "DeepSpeed compatibility key; only false (eps is added outside the sqrt)"})
    amsgrad: bool = field(default=False, metadata={"help": "DeepSpeed compatibility key; only false (AMSGrad is not supported)"})
    max_grad_norm: float = field(default=0.0, metadata={"help": "DeepSpeed compatibility key; only 0 (use gradient_clipping)"})
    cuda_aware: bool = field(default=False, metadata={"help": "DeepSpeed compatibility key; only false (it concerns DeepSpeed's MPI backend)"})
    comm_backend_name: str = field(
        default="nccl", metadata={"help": "DeepSpeed compatibility key; only nccl (qaccel uses the given torch.distributed group)"}
    )

    def _fail(self, key: str, value: object, allowed: str, error: type[SettingProblem] = SettingError) -> None:
        raise error(key, value, allowed, owner=type(self).__name__)

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
        if not isinstance(self.overlap_comm, bool):
            self._fail("overlap_comm", self.overlap_comm, "must be true or false", SettingTypeError)
        if not isinstance(self.variance_bias_correction, bool):
            self._fail("variance_bias_correction", self.variance_bias_correction, "must be true or false", SettingTypeError)
        # DeepSpeed keys that DeepSpeed itself ignores or rejects: accept only the value that is true.
        if self.bias_correction is not False:
            self._fail(
                "bias_correction",
                self.bias_correction,
                "must be False: DeepSpeed accepts the key and ignores it, so a DeepSpeed config that sets it means no "
                "bias correction; qaccel's own opt-in is variance_bias_correction",
            )
        if self.eps_inside_sqrt is not False:
            self._fail("eps_inside_sqrt", self.eps_inside_sqrt, "must be False: eps is always added outside the sqrt")
        if self.amsgrad is not False:
            self._fail("amsgrad", self.amsgrad, "must be False: AMSGrad is not supported", UnsupportedSetting)
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
                UnsupportedSetting,
            )

    @classmethod
    def resolve(
        cls,
        config: OneBitConfigBase | None = None,
        arguments: Mapping[str, Any] | None = None,
        *,
        recipe: str | os.PathLike | Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> OneBitConfigBase:
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

    @classmethod
    def from_deepspeed(cls, ds: str | os.PathLike | Mapping[str, Any]) -> OneBitConfigBase:
        """The config of a DeepSpeed JSON (a path or a dict): ``optimizer.params`` (its ``type`` must be this
        class's, any case) with the engine's ``gradient_clipping``; warns with the keys it ignores. See
        :mod:`qaccel.optim.deepspeed_json` and ``docs/from_deepspeed.md``.

        Raises:
            ValueError: another optimizer type, or a key qaccel cannot honour, naming it and what is allowed.
        """
        from .deepspeed_json import optimizer_config_from_deepspeed  # it imports this module

        return optimizer_config_from_deepspeed(cls, ds)


@dataclass(frozen=True, kw_only=True)
class ZeroOneAdamConfig(OneBitConfigBase):
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
        overlap_comm: start the 1-bit all-reduce of each DDP bucket's parameters in the communication hook,
            as their gradients become ready, and let the step only wait and apply (default True; results are
            bit-identical either way). Active on CPU (gloo) with a DDP model, and not with
            ``gradient_clipping`` (the global norm is known only after backward), an fp16 ``GradScaler`` or
            ``accelerator.clip_grad_norm_``; read when the DDP hook is registered.
        variance_bias_correction: divide ``sqrt(v)`` by ``sqrt(1 - beta2^k)``, ``k`` the variance updates ``v``
            holds, on every step that uses it (default False: DeepSpeed's numerics, bit for bit). Without it a
            variance frozen after ``k`` updates makes every later step up to ``1/sqrt(1 - beta2^k)`` times
            Adam's (about 7.9x at k = 16, beta2 = 0.999); ``qaccel train`` refuses settings where that exceeds
            4x (``docs/zero_one_adam.md``, "Bias correction of the frozen variance"). The momentum keeps
            DeepSpeed's rule (no correction): it only makes early steps smaller.
        bias_correction, eps_inside_sqrt, amsgrad, max_grad_norm, cuda_aware, comm_backend_name:
            DeepSpeed compatibility keys; only False / False / False / 0 / False / "nccl" are accepted.

    Environment and config file: ``QACCEL_ZERO_ONE_ADAM_<FIELD>`` (e.g. ``QACCEL_ZERO_ONE_ADAM_VAR_FREEZE_STEP=1000``)
    and the ``zero_one_adam`` section of the file named by ``QACCEL_CONFIG_FILE``; see :meth:`from_env`.
    ``ZeroOneAdam(params, lr=...)`` without a config reads both (argument > environment > recipe > default).

    Example::

        cfg = ZeroOneAdamConfig.from_dict({"lr": 1e-3, "var_freeze_step": 1000, "local_step_scaler": 1000})
        optimizer = ZeroOneAdam(model.parameters(), config=cfg)
    """

    ENV_PREFIX: ClassVar[str] = "QACCEL_ZERO_ONE_ADAM_"
    RECIPE_SECTION: ClassVar[str] = "zero_one_adam"

    var_freeze_step: int = field(
        default=100000, metadata={"help": "F: the last step that updates the variance; later steps are local steps (default 100000)"}
    )
    var_update_scaler: int = field(default=16, metadata={"help": "kappa: variance updates per interval before it doubles, >= 1 (default 16)"})
    local_step_scaler: int = field(
        default=32678, metadata={"help": "alpha: local steps between doublings of the sync interval, >= 1 (default 32678, DeepSpeed's)"}
    )
    local_step_clipper: int = field(default=16, metadata={"help": "H: the largest sync interval, >= 1 (default 16)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not _is_int(self.var_freeze_step) or self.var_freeze_step < 0:
            self._fail("var_freeze_step", self.var_freeze_step, "must be an int >= 0")
        for key in ("var_update_scaler", "local_step_scaler", "local_step_clipper"):
            value = getattr(self, key)
            if not _is_int(value) or value < 1:
                self._fail(key, value, "must be an int >= 1")


@dataclass(frozen=True, kw_only=True)
class OneBitAdamConfig(OneBitConfigBase):
    """Settings of 1-bit Adam (Tang et al. 2021), DeepSpeed ``OneBitAdam`` key names and defaults.

    Attributes:
        freeze_step: steps 2..max(freeze_step, 2) are full Adam with all-reduced gradients; later steps
            freeze the variance and send the momentum through the 1-bit all-reduce (default 100000; the
            DeepSpeed tutorial suggests 15-25% of the run).
        lr, betas, eps, weight_decay, granularity, padding, gradient_clipping, replica_check_interval,
            overlap_comm, variance_bias_correction and the compatibility keys: as in :class:`ZeroOneAdamConfig`
            (the variance freezes after ``max(freeze_step, 2) - 1`` updates).

    Environment and config file: ``QACCEL_ONEBIT_ADAM_<FIELD>`` and the ``onebit_adam`` section.
    """

    ENV_PREFIX: ClassVar[str] = "QACCEL_ONEBIT_ADAM_"
    RECIPE_SECTION: ClassVar[str] = "onebit_adam"

    freeze_step: int = field(
        default=100000, metadata={"help": "full Adam up to this step, then frozen variance and 1-bit momentum all-reduce (default 100000)"}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not _is_int(self.freeze_step) or self.freeze_step < 0:
            self._fail("freeze_step", self.freeze_step, "must be an int >= 0")
