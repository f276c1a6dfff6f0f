"""The measurement of ``qaccel bench quant --study error``: the tensors, and their round-trip error with and without rotation.

Real tensors are the parameters QSDP quantizes of a zoo recipe after a few AdamW steps, and their
gradients; synthetic ones are heavy-tailed draws with fixed seeds. Each tensor kind goes through one
encode/decode of the fused payload codecs per code width, rounding, rotation and seed.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..quant import PayloadSpec, decode_payloads, encode_payloads

logger = logging.getLogger(__name__)

__all__ = [
    "ROUNDINGS",
    "ROTATIONS",
    "SAMPLE_CHUNK",
    "TensorKind",
    "segment_seeds",
    "roundtrip",
    "relative_mse",
    "codec_buckets",
    "measure_errors",
    "summarize",
    "sample_chunks",
    "capture_recipe_tensors",
    "synthetic_kinds",
]

ROUNDINGS = ("stochastic", "nearest")
ROTATIONS = ("none", "hadamard")
# Sampling unit of a large kind: a multiple of every default bucket, so buckets never straddle two chunks.
SAMPLE_CHUNK = 1024
_OUTLIER_FRACTION = 0.001
_OUTLIER_FACTOR = 100.0


def segment_seeds(seed: int, segments: int) -> torch.Tensor:
    """The ``[1, segments]`` int64 encode seed table of one round trip, drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << 62, (1, segments), generator=generator, dtype=torch.int64)


def roundtrip(values: torch.Tensor, segments: tuple[int, ...], *, bits: int, bucket_size: int, meta_dtype: torch.dtype,
              rounding: str, rotation: str, seed: int) -> torch.Tensor:  # fmt: skip
    """Encode the flat fp32 ``values`` as one payload of quantized ``segments`` and decode it; returns fp32."""
    spec = PayloadSpec(tuple((numel, True) for numel in segments), bits, bucket_size, meta_dtype, rounding,
                       torch.float32, rotation)  # fmt: skip
    seeds = segment_seeds(seed, len(segments))
    blob = torch.empty(spec.nbytes, dtype=torch.uint8)
    encode_payloads(values, spec, [0], seeds, blob)
    decoded = torch.empty_like(values)
    return decode_payloads(blob, spec, decoded, [0], seeds)


def relative_mse(values: torch.Tensor, decoded: torch.Tensor) -> float:
    """``sum((decoded - values)^2) / sum(values^2)``, accumulated in fp64 (NaN for an all-zero tensor)."""
    x = values.double()
    total = float(x.square().sum())
    return float((decoded.double() - x).square().sum()) / total if total else math.nan


@dataclass(frozen=True)
class TensorKind:
    """One family of tensors: ``values`` (flat fp32) is the concatenation of ``segments`` (one per parameter)."""

    name: str
    values: torch.Tensor
    segments: tuple[int, ...]
    source: str

    def describe(self) -> dict:
        """Size and shape of the distribution: heavy tails are what the rotation is for."""
        x = self.values.double()
        centered = x - x.mean()
        variance = float(centered.square().mean())
        rms = float(x.square().mean().sqrt())
        return {
            "source": self.source,
            "numel": self.values.numel(),
            "segments": len(self.segments),
            "rms": rms,
            "max_abs_over_rms": float(x.abs().max()) / rms if rms else math.nan,
            "kurtosis": float(centered.pow(4).mean()) / variance**2 if variance else math.nan,
            "zero_fraction": float((x == 0).double().mean()),
        }


def codec_buckets(bits: int, bucket_override: int | None) -> tuple[int, torch.dtype]:
    """QSDP's per-bit default ``(bucket_size, meta_dtype)``, the bucket replaced by ``--bucket_size`` if given."""
    from ..fsdp.config import default_bucket

    bucket, meta = default_bucket(bits)
    return bucket_override or bucket, getattr(torch, meta)


def _error_row(kind: TensorKind, bits: int, bucket_size: int, meta_dtype: torch.dtype, rounding: str, seeds: int) -> dict:
    per_seed = {
        rotation: [relative_mse(kind.values, roundtrip(kind.values, kind.segments, bits=bits, bucket_size=bucket_size,
                                                       meta_dtype=meta_dtype, rounding=rounding, rotation=rotation,
                                                       seed=seed))
                   for seed in range(seeds)]
        for rotation in ROTATIONS
    }  # fmt: skip
    means = {rotation: statistics.fmean(errors) for rotation, errors in per_seed.items()}
    ratio = means["none"] / means["hadamard"] if means["hadamard"] > 0 else None
    return {
        "kind": kind.name,
        "bits": bits,
        "bucket_size": bucket_size,
        "meta_dtype": str(meta_dtype).replace("torch.", ""),
        "rounding": rounding,
        "rel_mse": means,
        "rel_mse_per_seed": per_seed,
        "ratio_none_over_hadamard": ratio,
    }


def measure_errors(kinds: list[TensorKind], bits_list: list[int], bucket_override: int | None, seeds: int) -> list[dict]:
    """One row per (kind, bits, rounding): the mean relative MSE without and with rotation, and their ratio."""
    rows = []
    for kind in kinds:
        for bits in bits_list:
            bucket_size, meta_dtype = codec_buckets(bits, bucket_override)
            for rounding in ROUNDINGS:
                logger.info("bench quant error: %s bits=%d %s", kind.name, bits, rounding)
                rows.append(_error_row(kind, bits, bucket_size, meta_dtype, rounding, seeds))
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per (bits, rounding): the geometric mean, min and max of none/hadamard over the tensor kinds."""
    groups: dict[tuple[int, str], list[float]] = {}
    for row in rows:
        if row["ratio_none_over_hadamard"] is not None:
            groups.setdefault((row["bits"], row["rounding"]), []).append(row["ratio_none_over_hadamard"])
    return [
        {"bits": bits, "rounding": rounding, "kinds": len(ratios), "geomean_ratio": statistics.geometric_mean(ratios),
         "min_ratio": min(ratios), "max_ratio": max(ratios)}
        for (bits, rounding), ratios in sorted(groups.items())
    ]  # fmt: skip


# -- tensors -----------------------------------------------------------------------------------------


def sample_chunks(tensors: list[torch.Tensor], stride: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Every ``stride``-th ``SAMPLE_CHUNK``-element chunk of each tensor (all of it when ``stride`` is 1), concatenated."""
    pieces, segments = [], []
    for tensor in tensors:
        flat = tensor.detach().reshape(-1).to(torch.float32)
        if stride > 1:
            chunks = flat.numel() // SAMPLE_CHUNK
            keep = torch.arange(0, chunks, stride)
            flat = flat[: chunks * SAMPLE_CHUNK].view(chunks, SAMPLE_CHUNK)[keep].reshape(-1)
        pieces.append(flat)
        segments.append(flat.numel())
    return torch.cat(pieces), tuple(segments)


def _forever(loader) -> Iterator[dict]:
    while True:
        yield from loader


def capture_recipe_tensors(recipe_name: str, train_steps: int, max_numel: int) -> tuple[list[TensorKind], dict]:
    """Weights after ``train_steps`` AdamW steps of a zoo recipe, and the gradients of one more backward.

    Returns the two kinds (``<recipe>/weights``, ``<recipe>/grads``) and what was captured. The
    parameters are those QSDP quantizes (``QSDPConfig.param_min_numel``, at least 2-D); single
    process, full precision, the recipe's batch size, data order seeded with its ``training.seed``.
    """
    from torch.utils.data import DataLoader
    from transformers import get_scheduler

    from ..fsdp.config import QSDPConfig
    from ..zoo import load_data, load_model, load_recipe, load_tokenizer

    recipe = load_recipe(recipe_name)
    training = recipe.training
    tokenizer = load_tokenizer(recipe)
    data = load_data(recipe, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(training.seed)
        model = load_model(recipe, tokenizer, label_names=data.label_names)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=training.learning_rate, weight_decay=training.weight_decay)
        scheduler = get_scheduler(training.lr_scheduler, optimizer=optimizer, num_warmup_steps=training.warmup_steps,
                                  num_training_steps=training.max_steps)  # fmt: skip
        loader = DataLoader(data.train, batch_size=training.per_device_batch_size, shuffle=True, drop_last=True,
                            collate_fn=data.collator, generator=torch.Generator().manual_seed(training.seed))  # fmt: skip
        batches = _forever(loader)
        losses = []
        for _ in range(train_steps):
            loss = model(**next(batches)).loss
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        model(**next(batches)).loss.backward()
    min_numel = QSDPConfig().param_min_numel
    named = [(name, p) for name, p in model.named_parameters() if p.dim() >= 2 and p.numel() >= min_numel]
    total = sum(p.numel() for _, p in named)
    stride = max(1, math.ceil(total / max_numel))
    weights, segments = sample_chunks([p for _, p in named], stride)
    grads, _ = sample_chunks([p.grad for _, p in named], stride)
    how = f"{recipe_name} after {train_steps} AdamW steps"
    kinds = [TensorKind(f"{recipe_name}/weights", weights, segments, how),
             TensorKind(f"{recipe_name}/grads", grads, segments, f"{how}: gradient of one more batch")]  # fmt: skip
    info = {
        "recipe": recipe_name,
        "train_steps": train_steps,
        "batch_size": training.per_device_batch_size,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "parameters": len(named),
        "parameter_numel": total,
        "sample_stride_chunks": stride,
    }
    return kinds, info


def synthetic_kinds(numel: int) -> list[TensorKind]:
    """Heavy-tailed data with fixed seeds: Student-t (2 and 3 degrees of freedom) and a Gaussian with 0.1% outliers x100."""

    def generator(seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    def student_t(df: int, seed: int) -> torch.Tensor:
        g = generator(seed)
        z = torch.randn(numel, generator=g)
        chi2 = torch.randn(df, numel, generator=g).square().sum(dim=0)  # (numel,)
        return z / (chi2 / df).sqrt()

    g = generator(3)
    outliers = torch.randn(numel, generator=g)
    picked = torch.randperm(numel, generator=g)[: max(1, round(numel * _OUTLIER_FRACTION))]
    outliers[picked] *= _OUTLIER_FACTOR
    one = (numel,)
    return [
        TensorKind("synthetic/student_t_df2", student_t(2, 1), one, "Student-t, 2 degrees of freedom"),
        TensorKind("synthetic/student_t_df3", student_t(3, 2), one, "Student-t, 3 degrees of freedom"),
        TensorKind("synthetic/gaussian_outliers", outliers, one,
                   f"N(0, 1) with {_OUTLIER_FRACTION:.1%} of the values x{_OUTLIER_FACTOR:g}"),
    ]  # fmt: skip
