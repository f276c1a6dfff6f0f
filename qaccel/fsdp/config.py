"""``QSDPConfig``: the validated settings of quantized FSDP2 (weights and gradients on the wire).

Precedence (``docs/qsdp.md``, "Settings"): explicit argument, then ``QACCEL_QSDP_<FIELD>``
environment variables, then the ``qsdp`` section of a config file (``QACCEL_CONFIG_FILE``, or the
``recipe`` argument; a zoo recipe such as ``model_cards/gpt2-tiny.md`` works too, its
``method.qsdp``), then the defaults below. Only the classmethods read the environment or files,
through the one settings reader, :mod:`qaccel._settings`.

Every field declares its reader (:mod:`qaccel._settings`: ``IntSetting``, ``ChoiceSetting``, ...),
which reads the value where it enters (keyword, environment, file or dict), so a value means the
same thing wherever it is written and no field changes after ``__init__``: ``off`` / ``none`` /
``false`` / ``32`` (any case), ``None``, ``False`` and the int ``32`` all switch a path off;
``auto`` / ``none`` / ``""`` and ``None`` pick the per-bit default of a bucket size or metadata
dtype; numbers may be given as decimal strings (an environment variable is always a string, and a
quoted YAML value is one too). The three quantized paths, each a :class:`PathSettings`, are
properties (:attr:`QSDPConfig.weight_path`, ``grad_path``, ``replica_path``) over the flat fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch

from .._settings import (
    AUTO,
    AUTO_WORDS,
    DEPRECATED_CONFIG_FILE_ENV,
    OFF,
    OFF_WORDS,
    READER,
    ChoiceSetting,
    IntSetting,
    SettingError,
    SettingsMixin,
    TruthSetting,
    settings_dataclass,
)
from ..comm import WireCodec
from ..quant import META_DTYPES, ROTATIONS, ROUNDINGS

__all__ = ["QSDPConfig", "PathSettings", "PRESETS", "MASTER_WEIGHT_MODES", "ERROR_FEEDBACK_DTYPES", "DEFAULT_ERROR_FEEDBACK_DTYPE", "ENV_PREFIX", "RECIPE_ENV", "OFF_WORDS", "AUTO_WORDS", "SPEED_ONLY_FIELDS"]

ENV_PREFIX = "QACCEL_QSDP_"
RECIPE_ENV = DEPRECATED_CONFIG_FILE_ENV  # deprecated name of qaccel._settings.CONFIG_FILE_ENV
MASTER_WEIGHT_MODES = ("fresh", "quantized")
# OFF_WORDS ("this path is off": bit widths) and AUTO_WORDS ("per-bit default": bucket size, meta
# dtype) are the settings core's (qaccel._settings), re-exported here under their old names.

# Stores of the gradient error-feedback buffer (grad_error_feedback), or off.
ERROR_FEEDBACK_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# The store that grad_error_feedback=True (or true/on/yes/1) means: full precision, as docs/qsdp.md's figures.
DEFAULT_ERROR_FEEDBACK_DTYPE = "float32"
# Settings that change how fast a step runs but not one bit of its results: a resume may change them.
SPEED_ONLY_FIELDS = ("prefetch", "overlap_reduce_scatter")

# How each field reads its value, from every source (the field readers of qaccel._settings).
_BITS = IntSetting(2, 8, unset=OFF)
_BUCKET = IntSetting(1, 1 << 24, unset=AUTO)
_META = ChoiceSetting(tuple(META_DTYPES), unset=AUTO, unset_help="auto/None (per-bit default)")
_ROTATION = ChoiceSetting(tuple(ROTATIONS))
_NUMEL = IntSetting(0, base=0)
_TRUTH = TruthSetting()


# Where each preset's measured bytes and loss are recorded: one table rendered from the benchmark JSON
# (docs/bench/*.json) by qaccel.bench.docs_render, so no figure is typed twice (tests/unit/test_rendered_docs.py).
_RECORDED = 'BENCHMARKS.md, "Presets: recorded results" (bytes on GPT-2 124M; final eval loss on gpt2-tiny and a MiniLM fine-tune)'

#: Named settings for :meth:`QSDPConfig.preset`: the fields they set and where what the project measured is recorded.
PRESETS: dict[str, dict[str, Any]] = {
    "w8g8": {
        "settings": {"weight_bits": 8, "grad_bits": 8},
        "measured": _RECORDED,
    },
    "w4g4": {
        "settings": {"weight_bits": 4, "grad_bits": 4},
        "measured": _RECORDED,
    },
    # Fine-tuning a pretrained model: stochastic 4-bit weights re-draw each forward pass's rounding of the
    # pretrained features, nearest rounding keeps one 4-bit copy; rotation tames heavy-tailed gradients.
    "w4g4-nearest-grad-hadamard": {
        "settings": {"weight_bits": 4, "grad_bits": 4, "rounding": "nearest", "grad_rotation": "hadamard"},
        "measured": _RECORDED,
    },
    # Below 4 bits round to nearest: half the error of stochastic rounding, and on gpt2-tiny closer to
    # FSDP2 than stochastic rounding, Hadamard rotation or error feedback (BENCHMARKS.md, "Fewer bits").
    "w3g3-nearest": {
        "settings": {"weight_bits": 3, "grad_bits": 3, "rounding": "nearest"},
        "measured": _RECORDED,
    },
    "w3g2-nearest": {
        "settings": {"weight_bits": 3, "grad_bits": 2, "rounding": "nearest"},
        "measured": _RECORDED,
    },
    "w2g2-nearest": {
        "settings": {"weight_bits": 2, "grad_bits": 2, "rounding": "nearest"},
        "measured": _RECORDED,
    },
}


def default_bucket(bits: int) -> tuple[int, str]:
    """Per-bit-width defaults ``(bucket_size, meta_dtype)``.

    8 bits: 1024-element buckets with fp32 metadata (1.008 B/element, 0.252x of fp32). At 7 bits
    and below a 1024-element bucket lets one outlier set a grid too coarse for the updates
    (``qsdp.md`` section 3.3: W4/B=1024 nearly stalled training, W4/B=128 did not), so the bucket
    shrinks to 128 and the metadata to bf16 (lo rounded down, scale up) to keep W4 at 0.133x.
    """
    return (1024, "float32") if bits >= 8 else (128, "bfloat16")


@dataclass(frozen=True)
class PathSettings:
    """How one path quantizes: the all-gather of weights, the reduce-scatter of gradients, or the replica all-reduce.

    :attr:`QSDPConfig.weight_path`, :attr:`~QSDPConfig.grad_path` and :attr:`~QSDPConfig.replica_path`
    gather a config's flat ``weight_*`` / ``grad_*`` / ``replica_grad_bits`` fields (and the shared
    ``rounding``) into one of these; :meth:`codec` fills in the per-bit defaults.

    Attributes:
        bits: bits per element, or ``None`` when the path is off (the stock collective).
        bucket_size: elements per bucket, or ``None`` for the per-bit default (:func:`default_bucket`).
        meta_dtype: ``"float32"``, ``"bfloat16"``, or ``None`` for the per-bit default.
        rotation: ``"none"`` or ``"hadamard"``.
        rounding: ``"stochastic"`` or ``"nearest"``.
    """

    bits: int | None
    bucket_size: int | None = None
    meta_dtype: str | None = None
    rotation: str = "none"
    rounding: str = "stochastic"

    def codec(self) -> WireCodec | None:
        """The path's quantizer with the per-bit defaults filled in, or ``None`` when the path is off."""
        if self.bits is None:
            return None
        default_size, default_meta = default_bucket(self.bits)
        return WireCodec(
            bits=self.bits,
            bucket_size=self.bucket_size if self.bucket_size is not None else default_size,
            meta_dtype=META_DTYPES[self.meta_dtype if self.meta_dtype is not None else default_meta],
            rounding=self.rounding,
            rotation=self.rotation,
        )


@settings_dataclass
class QSDPConfig(SettingsMixin):
    """Settings of QSDP (Markov et al., ICML 2023) on FSDP2.

    Attributes:
        weight_bits: bits per weight on the all-gather, int in [2, 8], or off for the stock
            collective: ``None``, ``False``, ``32`` or the words ``off``/``none``/``false``/``32``
            (any case) are all stored as ``None``, from code, ``QACCEL_QSDP_WEIGHT_BITS`` or a
            recipe alike. Default 8.
        grad_bits: bits per gradient on the reduce-scatter, as above. Default 8.
        replica_grad_bits: hierarchical QSDP only (HSDP: sharded within a node, replicated across
            nodes; ``docs/qsdp.md``, "Hierarchical QSDP"): bits per gradient of the all-reduce of
            each gradient shard across the replicas, a quantized reduce-scatter plus all-gather over
            the replica group, int in [2, 8] (per-bit bucket defaults, ``rounding``), or off for an
            exact fp32 all-reduce. ``weight_bits`` and ``grad_bits`` then apply inside a node. Ignored
            on a 1-D mesh. Default 4.
        weight_bucket_size: elements per quantization bucket of weights, >= 1, or ``None`` (also
            ``auto``/``none``/``""``) for the per-bit default (1024 at 8 bits, 128 below). Smaller
            buckets: finer grid, more metadata.
        grad_bucket_size: the same for gradients.
        weight_meta_dtype: ``"float32"``, ``"bfloat16"`` or ``None`` (also ``auto``/``none``/``""``;
            per-bit default: fp32 at 8 bits, bf16 below). bf16 halves the metadata; lo is rounded
            down, scale up.
        grad_meta_dtype: the same for gradients.
        rounding: ``"stochastic"`` (unbiased, the paper's quantizer; default) or ``"nearest"``
            (half the error, biased).
        seed: unsigned 64-bit seed; every codec call derives its noise from (seed, optimizer step,
            FSDP unit, owner rank, direction, destination, and for gradients the reduce-scatter
            call within the step), so runs are reproducible. Default 0.
        master_weights: ``"fresh"`` (default): the owner keeps its full-precision shard and
            quantizes it freshly before every all-gather. ``"quantized"``: after every optimizer
            step the shard is replaced by its stochastically rounded value (the iteration the
            paper's theorem analyses); requires ``weight_bits``.
        param_min_numel: parameters that are 1-D or have fewer elements travel unquantized (raw)
            inside a quantized unit. Default 1024, as CGX's ``layer_min_size``.
        unit_min_numel: FSDP units whose padded shard has fewer elements keep the stock
            collectives (e.g. Accelerate's final-norm unit), since metadata and launch overhead
            outweigh the saving. Default 4096; 0 quantizes every unit.
        weight_rotation: ``"none"`` (default) or ``"hadamard"``: rotate every weight bucket by a
            randomized Walsh-Hadamard transform (random signs from the call's seed, power-of-two
            blocks of at most 1024 elements) before quantizing, and back after decoding
            (``docs/qsdp.md``, "Rotation"). An outlier is spread over its block, so the bucket's grid
            fits the other values: the error at 2-4 bits drops several-fold on heavy-tailed data.
            Bytes on the wire do not change. Not with ``master_weights="quantized"``.
        grad_rotation: the same for the gradient reduce-scatter. The all-reduce across replicas of
            hierarchical QSDP is not rotated.
        grad_error_feedback: ``None`` (off, default; also ``False`` and ``off``/``none``/``false``/
            ``no``/``0``), ``"float32"`` or ``"bfloat16"``, or ``True`` (also ``true``/``on``/``yes``/
            ``1``), which means ``"float32"`` and is stored as that name: each rank keeps what its
            quantized reduce-scatter left out of the chunks it sent, ``e = (g + e) - Q(g + e)``, and
            adds it to the next call's gradient before encoding (1-bit Adam's and LoCo's error feedback). Memory: ``(P-1)/P`` of every quantized
            unit's gradient per rank, in the chosen dtype. Saved in checkpoints; reset (with a
            warning) when a run resumes on another world size. Needs ``grad_bits``.
        prefetch: overlap all-gathers with compute: every unit prefetches its neighbour's
            all-gather asynchronously in forward and backward (:func:`qaccel.fsdp.apply_prefetch`).
            Results are bit-identical either way; the price is one more unit's unsharded weights in
            memory. ``True`` (default), ``False``, or ``1``/``0``/``on``/``off``/``true``/``false``
            (``QACCEL_QSDP_PREFETCH``).
        overlap_reduce_scatter: on CPU (gloo), return from each unit's reduce-scatter with its
            transport still running and finish it when the next unit's reduce-scatter starts or
            backward ends, so the transport overlaps the rest of backward (``docs/qsdp.md``,
            "Overlap"). Gradients are bit-identical either way; a call whose output something may
            read before backward ends (hierarchical QSDP's replica all-reduce hook,
            post-accumulate-grad hooks, CPU offload) runs synchronously. No effect on CUDA, where
            FSDP2's reduce-scatter stream overlaps. ``True`` (default), ``False``, or the words
            ``prefetch`` takes (``QACCEL_QSDP_OVERLAP_REDUCE_SCATTER``).
    """

    ENV_PREFIX: ClassVar[str] = ENV_PREFIX
    RECIPE_SECTION: ClassVar[str] = "qsdp"
    UNKNOWN_ENV: ClassVar[str] = "unknown QSDP setting"

    weight_bits: int | None = field(
        default=8,
        metadata={READER: _BITS, "help": "bits per weight on the FSDP2 all-gather: 2..8, or off for the stock collective (default 8)"},
    )
    grad_bits: int | None = field(
        default=8,
        metadata={READER: _BITS, "help": "bits per gradient on the FSDP2 reduce-scatter: 2..8, or off for the stock collective (default 8)"},
    )
    replica_grad_bits: int | None = field(
        default=4,
        metadata={READER: _BITS,
                  "help": "hierarchical QSDP (HSDP): bits per gradient of the all-reduce across nodes (replicas): 2..8, or "
                          "off for an exact fp32 all-reduce (default 4; ignored on a 1-D mesh)"},
    )  # fmt: skip
    weight_bucket_size: int | None = field(
        default=None,
        metadata={READER: _BUCKET, "help": "elements per weight quantization bucket, >= 1, or auto (1024 at 8 bits, 128 below)"},
    )
    grad_bucket_size: int | None = field(
        default=None,
        metadata={READER: _BUCKET, "help": "elements per gradient quantization bucket, >= 1, or auto (1024 at 8 bits, 128 below)"},
    )
    weight_meta_dtype: str | None = field(
        default=None,
        metadata={READER: _META, "help": "dtype of the weight buckets' lo/scale: float32, bfloat16, or auto (fp32 at 8 bits, bf16 below)"},
    )
    grad_meta_dtype: str | None = field(
        default=None,
        metadata={READER: _META, "help": "dtype of the gradient buckets' lo/scale: float32, bfloat16, or auto (fp32 at 8 bits, bf16 below)"},
    )
    rounding: str = field(
        default="stochastic",
        metadata={READER: ChoiceSetting(tuple(ROUNDINGS)),
                  "help": "stochastic (unbiased, the paper's quantizer; default) or nearest (half the error, biased)"},
    )  # fmt: skip
    seed: int = field(
        default=0, metadata={READER: IntSetting(0, (1 << 64) - 1, base=0), "help": "unsigned 64-bit seed of the quantization noise (default 0)"}
    )
    master_weights: str = field(
        default="fresh",
        metadata={READER: ChoiceSetting(MASTER_WEIGHT_MODES),
                  "help": "fresh: quantize the full-precision shard before every all-gather (default); quantized: "
                          "round the shard itself after every step (the paper's iteration; needs weight_bits)"},
    )  # fmt: skip
    param_min_numel: int = field(
        default=1024, metadata={READER: _NUMEL, "help": "parameters that are 1-D or smaller than this travel unquantized (default 1024)"}
    )
    unit_min_numel: int = field(
        default=4096,
        metadata={READER: _NUMEL, "help": "FSDP units whose padded shard is smaller keep the stock collectives; 0 quantizes all (default 4096)"},
    )
    weight_rotation: str = field(
        default="none",
        metadata={READER: _ROTATION, "help": "none (default) or hadamard: rotate weight buckets by a randomized Hadamard transform before quantizing"},
    )
    grad_rotation: str = field(
        default="none",
        metadata={READER: _ROTATION, "help": "none (default) or hadamard: rotate gradient buckets by a randomized Hadamard transform before quantizing"},
    )
    grad_error_feedback: str | None = field(
        default=None,
        metadata={READER: ChoiceSetting(tuple(ERROR_FEEDBACK_DTYPES), on=DEFAULT_ERROR_FEEDBACK_DTYPE),
                  "help": "off (default), float32 or bfloat16: carry each rank's gradient rounding error into the next "
                          "reduce-scatter, stored in this dtype ((P-1)/P of the quantized gradients per rank); true: float32"},
    )  # fmt: skip
    prefetch: bool = field(
        default=True,
        metadata={READER: _TRUTH, "help": "overlap each unit's all-gather with its neighbour's compute; same results, one more unit in memory (default true)"},
    )
    overlap_reduce_scatter: bool = field(
        default=True,
        metadata={READER: _TRUTH,
                  "help": "overlap each unit's reduce-scatter with the rest of backward on CPU (gloo); same gradients, bit for bit "
                          "(default true)"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        # Each field was read by its reader on the way in (settings_dataclass); what is left are the
        # rules across fields.
        if self.master_weights == "quantized" and self.weight_bits is None:
            raise SettingError("master_weights", "quantized", "requires weight_bits in [2, 8], got weight_bits=None (off)", owner="QSDPConfig")
        if self.master_weights == "quantized" and self.weight_rotation != "none":
            raise SettingError(
                "master_weights", "quantized", "the quantized master iteration keeps shards on the unrotated grid; use "
                "master_weights='fresh' or weight_rotation='none'", owner="QSDPConfig", together_with=f"weight_rotation={self.weight_rotation!r}",
            )  # fmt: skip
        if self.grad_error_feedback is not None and self.grad_bits is None:
            raise SettingError("grad_error_feedback", allowed="needs grad_bits in [2, 8]; got grad_bits=None (off), whose exact "
                               "reduce-scatter has no error to feed back", owner="QSDPConfig")  # fmt: skip

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> QSDPConfig:
        """A named setting of :data:`PRESETS` (``BENCHMARKS.md`` has the measurements behind each), ``overrides`` on top.

        Example::

            QSDPConfig.preset("w4g4")                 # 4-bit weights and gradients, the per-bit defaults
            QSDPConfig.preset("w4g4", seed=3)         # the same with another noise seed

        Raises:
            ValueError: an unknown name (listing the known ones) or a bad override.
        """
        if name not in PRESETS:
            raise ValueError(f"QSDPConfig.preset({name!r}): unknown preset; choose from {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name]["settings"], **overrides})

    def differences(self, other: QSDPConfig) -> dict[str, tuple[Any, Any]]:
        """``{field: (self's value, other's value)}`` for every field that changes results and differs."""
        return {
            f.name: (getattr(self, f.name), getattr(other, f.name))
            for f in fields(self)
            if f.name not in SPEED_ONLY_FIELDS and getattr(self, f.name) != getattr(other, f.name)
        }

    # -- the three quantized paths -----------------------------------------------------------
    @property
    def weight_path(self) -> PathSettings:
        """The all-gather of weights: ``weight_bits``, ``weight_bucket_size``, ``weight_meta_dtype``, ``weight_rotation``."""
        return PathSettings(self.weight_bits, self.weight_bucket_size, self.weight_meta_dtype, self.weight_rotation, self.rounding)

    @property
    def grad_path(self) -> PathSettings:
        """The reduce-scatter of gradients: ``grad_bits``, ``grad_bucket_size``, ``grad_meta_dtype``, ``grad_rotation``."""
        return PathSettings(self.grad_bits, self.grad_bucket_size, self.grad_meta_dtype, self.grad_rotation, self.rounding)

    @property
    def replica_path(self) -> PathSettings:
        """The all-reduce across replicas (hierarchical QSDP): ``replica_grad_bits``, per-bit buckets, not rotated."""
        return PathSettings(self.replica_grad_bits, rounding=self.rounding)

    def weight_codec(self) -> WireCodec | None:
        """The all-gather quantizer with per-bit defaults filled in, or ``None`` when off."""
        return self.weight_path.codec()

    def grad_codec(self) -> WireCodec | None:
        """The reduce-scatter quantizer with per-bit defaults filled in, or ``None`` when off."""
        return self.grad_path.codec()

    def error_feedback_dtype(self) -> torch.dtype | None:
        """The dtype of the gradient error-feedback store, or ``None`` when error feedback is off."""
        return None if self.grad_error_feedback is None else ERROR_FEEDBACK_DTYPES[self.grad_error_feedback]

    def replica_grad_codec(self) -> WireCodec | None:
        """The quantizer of the all-reduce across replicas (per-bit bucket defaults), or ``None`` when off."""
        return self.replica_path.codec()
