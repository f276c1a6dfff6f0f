"""``QSDPConfig``: the validated settings of quantized FSDP2 (weights and gradients on the wire).

Precedence (``shared/design/style.md`` section 7): explicit argument, then ``QACCEL_QSDP_<FIELD>``
environment variables, then the ``qsdp`` section of a recipe file (``QACCEL_RECIPE`` or the
``recipe`` argument), then the defaults below. Only the classmethods read the environment or files.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ..comm import WireCodec
from ..quant import META_DTYPES, ROUNDINGS

__all__ = ["QSDPConfig", "MASTER_WEIGHT_MODES", "ENV_PREFIX", "RECIPE_ENV"]

ENV_PREFIX = "QACCEL_QSDP_"
RECIPE_ENV = "QACCEL_RECIPE"
MASTER_WEIGHT_MODES = ("fresh", "quantized")
_OFF_WORDS = ("off", "none", "32")
_AUTO_WORDS = ("auto", "none", "")


def default_bucket(bits: int) -> tuple[int, str]:
    """Per-bit-width defaults ``(bucket_size, meta_dtype)``.

    8 bits: 1024-element buckets with fp32 metadata (1.008 B/element, 0.252x of fp32). At 7 bits
    and below a 1024-element bucket lets one outlier set a grid too coarse for the updates
    (``qsdp.md`` section 3.3: W4/B=1024 nearly stalled training, W4/B=128 did not), so the bucket
    shrinks to 128 and the metadata to bf16 (lo rounded down, scale up) to keep W4 at 0.133x.
    """
    return (1024, "float32") if bits >= 8 else (128, "bfloat16")


@dataclass(frozen=True, kw_only=True)
class QSDPConfig:
    """Settings of QSDP (Markov et al., ICML 2023) on FSDP2.

    Attributes:
        weight_bits: bits per weight on the all-gather, int in [2, 8], or ``None`` for the stock
            collective (env ``QACCEL_QSDP_WEIGHT_BITS``; ``off``/``none``/``32`` mean ``None``).
            Default 8.
        grad_bits: bits per gradient on the reduce-scatter, as above. Default 8.
        weight_bucket_size: elements per quantization bucket of weights, >= 1, or ``None`` for the
            per-bit default (1024 at 8 bits, 128 below). Smaller buckets: finer grid, more metadata.
        grad_bucket_size: the same for gradients.
        weight_meta_dtype: ``"float32"``, ``"bfloat16"`` or ``None`` (per-bit default: fp32 at 8
            bits, bf16 below). bf16 halves the metadata; lo is rounded down, scale up.
        grad_meta_dtype: the same for gradients.
        rounding: ``"stochastic"`` (unbiased, the paper's quantizer; default) or ``"nearest"``
            (half the error, biased).
        seed: unsigned 64-bit seed; every codec call derives its noise from (seed, optimizer step,
            FSDP unit, owner rank, direction, destination), so runs are reproducible. Default 0.
        master_weights: ``"fresh"`` (default): the owner keeps its full-precision shard and
            quantizes it freshly before every all-gather. ``"quantized"``: after every optimizer
            step the shard is replaced by its stochastically rounded value (the iteration the
            paper's theorem analyses); requires ``weight_bits``.
        param_min_numel: parameters that are 1-D or have fewer elements travel unquantized (raw)
            inside a quantized unit. Default 1024, as CGX's ``layer_min_size``.
        unit_min_numel: FSDP units whose padded shard has fewer elements keep the stock
            collectives (e.g. Accelerate's final-norm unit), since metadata and launch overhead
            outweigh the saving. Default 4096; 0 quantizes every unit.
    """

    weight_bits: int | None = 8
    grad_bits: int | None = 8
    weight_bucket_size: int | None = None
    grad_bucket_size: int | None = None
    weight_meta_dtype: str | None = None
    grad_meta_dtype: str | None = None
    rounding: str = "stochastic"
    seed: int = 0
    master_weights: str = "fresh"
    param_min_numel: int = 1024
    unit_min_numel: int = 4096

    def __post_init__(self) -> None:
        for name in ("weight_bits", "grad_bits"):
            _check_int(name, getattr(self, name), 2, 8, allow_none=True, none_means="off")
        for name in ("weight_bucket_size", "grad_bucket_size"):
            _check_int(name, getattr(self, name), 1, 1 << 24, allow_none=True, none_means="per-bit default")
        for name in ("weight_meta_dtype", "grad_meta_dtype"):
            value = getattr(self, name)
            if value is not None and value not in META_DTYPES:
                raise ValueError(f"QSDPConfig.{name}={value!r}: must be one of {', '.join(META_DTYPES)} or None (per-bit default)")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"QSDPConfig.rounding={self.rounding!r}: must be one of {', '.join(ROUNDINGS)}")
        _check_int("seed", self.seed, 0, (1 << 64) - 1)
        if self.master_weights not in MASTER_WEIGHT_MODES:
            raise ValueError(f"QSDPConfig.master_weights={self.master_weights!r}: must be one of {', '.join(MASTER_WEIGHT_MODES)}")
        if self.master_weights == "quantized" and self.weight_bits is None:
            raise ValueError("QSDPConfig.master_weights='quantized': requires weight_bits in [2, 8], got weight_bits=None (off)")
        _check_int("param_min_numel", self.param_min_numel, 0)
        _check_int("unit_min_numel", self.unit_min_numel, 0)

    # -- resolved codecs ---------------------------------------------------------------------
    def weight_codec(self) -> WireCodec | None:
        """The all-gather quantizer with per-bit defaults filled in, or ``None`` when off."""
        return _codec(self.weight_bits, self.weight_bucket_size, self.weight_meta_dtype, self.rounding)

    def grad_codec(self) -> WireCodec | None:
        """The reduce-scatter quantizer with per-bit defaults filled in, or ``None`` when off."""
        return _codec(self.grad_bits, self.grad_bucket_size, self.grad_meta_dtype, self.rounding)

    # -- (de)serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict; ``QSDPConfig.from_dict(c.to_dict()) == c``."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "dict") -> QSDPConfig:
        """Build from a mapping of field names; unknown keys are errors naming the known ones."""
        if not isinstance(values, Mapping):
            raise TypeError(f"QSDPConfig.from_dict: expected a mapping, got {type(values).__name__} (from {source})")
        return cls._build(values, {k: source for k in values})

    @classmethod
    def _build(cls, values: Mapping[str, Any], sources: Mapping[str, str]) -> QSDPConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            where = sorted({sources.get(k, "?") for k in unknown})
            raise ValueError(f"QSDPConfig: unknown keys {unknown} (from {', '.join(where)}); known keys: {sorted(known)}")
        with _naming_source(sources):
            return cls(**dict(values))

    @classmethod
    def from_file(cls, path: str | os.PathLike, **overrides: Any) -> QSDPConfig:
        """Read the ``qsdp`` section of a YAML or JSON recipe file; ``overrides`` win."""
        section = _read_recipe(Path(path))
        merged = {**section, **overrides}
        sources = {k: f"recipe {path}" for k in section} | {k: "argument" for k in overrides}
        return cls._build(merged, sources)

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        recipe: str | os.PathLike | None = None,
        **overrides: Any,
    ) -> QSDPConfig:
        """Explicit ``overrides``, then ``QACCEL_QSDP_*`` variables, then a recipe, then defaults.

        Args:
            environ: the environment to read (default ``os.environ``).
            recipe: a recipe file; default: the file named by ``QACCEL_RECIPE``, if set.
            **overrides: field values given in code; ``None`` for a bits field means "off".

        Raises:
            ValueError: for an unknown ``QACCEL_QSDP_*`` name or a bad value, naming its source.
        """
        environ = os.environ if environ is None else environ
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        recipe = recipe if recipe is not None else environ.get(RECIPE_ENV) or None
        if recipe is not None:
            section = _read_recipe(Path(recipe))
            values.update(section)
            sources.update({k: f"recipe {recipe}" for k in section})
        for env_name, raw in environ.items():
            if not env_name.startswith(ENV_PREFIX):
                continue
            field_name = env_name[len(ENV_PREFIX) :].lower()
            if field_name not in known:
                names = ", ".join(ENV_PREFIX + n.upper() for n in sorted(known))
                raise ValueError(f"{env_name}: unknown QSDP setting; known names: {names}")
            values[field_name] = _parse_env(field_name, raw, env_name)
            sources[field_name] = env_name
        values.update(overrides)
        sources.update({k: "argument" for k in overrides})
        return cls._build(values, sources)


def _codec(bits: int | None, bucket: int | None, meta: str | None, rounding: str) -> WireCodec | None:
    if bits is None:
        return None
    default_size, default_meta = default_bucket(bits)
    return WireCodec(
        bits=bits,
        bucket_size=bucket if bucket is not None else default_size,
        meta_dtype=META_DTYPES[meta if meta is not None else default_meta],
        rounding=rounding,
    )


def _check_int(name: str, value: object, low: int, high: int | None = None, *, allow_none: bool = False, none_means: str = "") -> None:
    if value is None and allow_none:
        return
    allowed = f"an int in [{low}, {high}]" if high is not None else f"an int >= {low}"
    if allow_none:
        allowed += f" or None ({none_means})"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"QSDPConfig.{name}={value!r}: must be {allowed}")
    if value < low or (high is not None and value > high):
        raise ValueError(f"QSDPConfig.{name}={value}: must be {allowed}")


def _parse_env(field_name: str, raw: str, env_name: str) -> Any:
    """One parser per field type; raises ValueError naming the variable."""
    text = raw.strip()
    lowered = text.lower()
    try:
        if field_name in ("weight_bits", "grad_bits"):
            return None if lowered in _OFF_WORDS else int(text)
        if field_name in ("weight_bucket_size", "grad_bucket_size"):
            return None if lowered in _AUTO_WORDS else int(text)
        if field_name in ("weight_meta_dtype", "grad_meta_dtype"):
            return None if lowered in _AUTO_WORDS else lowered
        if field_name in ("seed", "param_min_numel", "unit_min_numel"):
            return int(text, 0)
        return lowered
    except ValueError:
        raise ValueError(f"{env_name}={raw!r}: not a valid value for QSDPConfig.{field_name}") from None


def _read_recipe(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"QSDP recipe {str(path)!r}: no such file")
    text = path.read_text()
    if path.suffix.lower() == ".json":
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    if not isinstance(data, Mapping) or not isinstance(data.get("qsdp", {}), Mapping):
        raise ValueError(f"QSDP recipe {str(path)!r}: must be a mapping with a 'qsdp' mapping section")
    return dict(data.get("qsdp", {}))


class _naming_source:
    """Re-raise a field's validation error with where the value came from (env name, file, ...)."""

    _pattern = re.compile(r"^QSDPConfig\.(\w+)")

    def __init__(self, sources: Mapping[str, str]) -> None:
        self.sources = dict(sources)

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None or not isinstance(exc, (ValueError, TypeError)) or "(from " in str(exc):
            return False
        match = self._pattern.match(str(exc))
        if match and match.group(1) in self.sources:
            raise type(exc)(f"{exc} (from {self.sources[match.group(1)]})") from None
        return False

