"""``qaccel bench quant --study error``: round-trip error of low-bit codecs with and without Hadamard rotation.

Issue 20 ("Fewer bits at the same loss") rotates every bucket by a randomized Hadamard transform
before quantizing (``qaccel.quant.reference``, steps 7-10), so one large value no longer sets the
grid of its whole bucket. This study measures what that buys and what it costs:

* Tensors. Real ones: the parameters QSDP quantizes (at least 2-D and ``param_min_numel`` elements,
  as ``UnitPlan.build`` decides) of each ``--models`` recipe, built by the zoo from its recipe and
  trained ``--train_steps`` AdamW steps (the recipe's learning rate, weight decay and schedule) on
  its offline training data in this process, and their gradients of one more backward. Each
  parameter is one payload segment (buckets restart at every segment, as in QSDP). A kind larger
  than ``--max_numel`` keeps every k-th 1024-element chunk of every parameter, so buckets (whose
  size divides 1024) stay contiguous pieces of one parameter. Synthetic ones (fixed seeds,
  ``--synthetic_numel`` values each): Student-t with 2 and 3 degrees of freedom, and a Gaussian
  whose 0.1% of values are multiplied by 100.
* Errors. For every kind, code width, rounding (stochastic, nearest) and rotation (none, hadamard),
  with the per-bit default bucket (``qaccel.fsdp.config.default_bucket``) unless ``--bucket_size``
  overrides it: the relative MSE ``sum((x_hat - x)^2) / sum(x^2)`` of one encode/decode round trip
  through the fused payload codecs, averaged over ``--seeds`` seeds (they draw the rounding noise
  and the rotation signs), and the ratio none/hadamard (above 1: the rotation helps).
* Timing. On one thread, on ``--timing_numel`` Gaussian values: the median time of
  ``encode_payloads`` and ``decode_payloads`` with rotation over the same call without, for 4-bit
  b128 bf16 and 8-bit b1024 fp32 payloads, the four calls timed in turns. The goal is at most 1.5x
  for the encode (the transform is O(n log B) next to the O(n) quantizer), judged on the thread's
  CPU time so that other jobs on a shared machine do not decide it; wall-clock ratios are reported
  too. Only a native backend's ratio says anything about the kernel: on the pure-torch reference
  the study times ``_REFERENCE_TIMING_NUMEL`` values and leaves the goal unjudged.

Backends are bit-identical, so the errors do not depend on which one ``QACCEL_KERNELS`` picks; the
report records it.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from ..quant import PayloadSpec, _backend, decode_payloads, encode_payloads, reference
from ._figures import headless_pyplot, png_path, save_figure
from ._quant_inputs import QuantInputError, parse_bits

logger = logging.getLogger(__name__)

__all__ = [
    "ERROR_DEFAULTS",
    "TensorKind",
    "add_arguments",
    "run",
    "roundtrip",
    "relative_mse",
    "capture_recipe_tensors",
    "synthetic_kinds",
    "markdown",
]

ERROR_DEFAULTS = {
    "bits": "2,3,4,8",
    "models": "gpt2-tiny,minilm-finetune",
    "train_steps": 20,
    "max_numel": 1 << 21,
    "synthetic_numel": 1 << 20,
    "seeds": 3,
    "timing_numel": 1 << 24,
    "markdown": None,
}
ROUNDINGS = ("stochastic", "nearest")
ROTATIONS = ("none", "hadamard")
# Encode with rotation over encode without, on one thread (issue 20's goal).
GOAL_ROTATION_SLOWDOWN = 1.5
# Sampling unit of a large kind: a multiple of every default bucket, so buckets never straddle two chunks.
SAMPLE_CHUNK = 1024
# The reference codec holds int64/fp64 temporaries per value: time it on fewer values.
_REFERENCE_TIMING_NUMEL = 1 << 20
# Payloads timed against each other: (bits, bucket_size, meta_dtype).
_TIMED_CODECS = ((4, 128, torch.bfloat16), (8, 1024, torch.float32))
_OUTLIER_FRACTION = 0.001
_OUTLIER_FACTOR = 100.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the error study; None means "not given" (``qaccel.bench.quant`` rejects them on the other study)."""
    d = ERROR_DEFAULTS
    parser.add_argument("--models", default=None,
                        help=f"error study: comma-separated zoo recipes whose weights and gradients to capture, "
                             f"or 'none' for synthetic data only (default {d['models']})")  # fmt: skip
    parser.add_argument("--train_steps", type=int, default=None,
                        help=f"error study: AdamW steps before the weights and gradients are captured (default {d['train_steps']})")  # fmt: skip
    parser.add_argument("--max_numel", type=int, default=None,
                        help=f"error study: values kept per captured tensor kind, sampled in 1024-element chunks (default {d['max_numel']})")  # fmt: skip
    parser.add_argument("--synthetic_numel", type=int, default=None,
                        help=f"error study: values per synthetic tensor (default {d['synthetic_numel']})")
    parser.add_argument("--seeds", type=int, default=None,
                        help=f"error study: rounding/rotation seeds each error is averaged over (default {d['seeds']})")
    parser.add_argument("--timing_numel", type=int, default=None,
                        help=f"error study: fp32 values of the one-thread rotation timing, 0 to skip it (default {d['timing_numel']})")  # fmt: skip
    parser.add_argument("--markdown", default=None, help="error study: write the Markdown tables here")


# -- the measurement ---------------------------------------------------------------------------------


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


# -- timing ------------------------------------------------------------------------------------------


def backend_name(kernels) -> str:
    """``reference`` or the native backend's name (``cpu``)."""
    return "reference" if kernels is reference else kernels.__name__.rsplit(".", 1)[-1]


def _interleaved_medians(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, dict[str, float]]:
    """Median wall-clock and thread-CPU seconds of each call, timed in turns after one warm-up round.

    Taking turns spreads a neighbour's load over every call alike; the calling thread's CPU time
    (one torch thread runs the kernel inline) leaves out the time it waited for a core.
    """
    for call in calls.values():
        call()
    wall: dict[str, list[float]] = {name: [] for name in calls}
    cpu: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            wall_start, cpu_start = time.perf_counter(), time.thread_time()
            call()
            cpu[name].append(time.thread_time() - cpu_start)
            wall[name].append(time.perf_counter() - wall_start)
    return {name: {"wall_s": statistics.median(wall[name]), "cpu_s": statistics.median(cpu[name])} for name in calls}


def _codec_calls(numel: int, bits: int, bucket_size: int, meta_dtype: torch.dtype, values: torch.Tensor,
                 decoded: torch.Tensor, seeds: torch.Tensor) -> dict[str, Callable[[], object]]:  # fmt: skip
    """``<op>/<rotation>`` -> one encode or decode of ``values`` as a one-segment payload."""
    calls = {}
    for rotation in ROTATIONS:
        spec = PayloadSpec(((numel, True),), bits, bucket_size, meta_dtype, "stochastic", torch.float32, rotation)
        blob = torch.empty(spec.nbytes, dtype=torch.uint8)
        calls[f"encode/{rotation}"] = partial(encode_payloads, values, spec, [0], seeds, blob)
        calls[f"decode/{rotation}"] = partial(decode_payloads, blob, spec, decoded, [0], seeds)
    return calls


def time_rotation(numel: int, repeats: int) -> dict:
    """Encode/decode seconds with and without rotation on one thread, their ratios, and the goal's verdict.

    The goal is judged on thread CPU time, which other processes on a shared machine do not inflate;
    wall-clock medians and their ratios are reported beside it.
    """
    backend = backend_name(_backend.kernels_for("cpu"))
    if backend == "reference":
        numel = min(numel, _REFERENCE_TIMING_NUMEL)
    values = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    decoded = torch.empty_like(values)
    seeds = segment_seeds(0, 1)
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for bits, bucket_size, meta_dtype in _TIMED_CODECS:
            logger.info("bench quant error: timing %s b%d", backend, bits)
            calls = _codec_calls(numel, bits, bucket_size, meta_dtype, values, decoded, seeds)
            times = _interleaved_medians(calls, repeats)
            row: dict = {"bits": bits, "bucket_size": bucket_size, "meta_dtype": str(meta_dtype).replace("torch.", ""),
                         "numel": numel}  # fmt: skip
            for op in ("encode", "decode"):
                for clock, suffix in (("wall_s", "s"), ("cpu_s", "cpu_s")):
                    row[f"{op}_{suffix}"] = {rotation: times[f"{op}/{rotation}"][clock] for rotation in ROTATIONS}
                row[f"{op}_ratio"] = row[f"{op}_s"]["hadamard"] / row[f"{op}_s"]["none"]
                row[f"{op}_cpu_ratio"] = row[f"{op}_cpu_s"]["hadamard"] / row[f"{op}_cpu_s"]["none"]
            rows.append(row)
    finally:
        torch.set_num_threads(threads)
    worst = max(row["encode_cpu_ratio"] for row in rows)
    judged = backend != "reference"
    return {
        "backend": backend,
        "threads": 1,
        "repeats": repeats,
        "rows": rows,
        "goal": {"max_encode_ratio": GOAL_ROTATION_SLOWDOWN, "judged_on": "thread CPU time", "worst_encode_ratio": worst,
                 "met": (worst <= GOAL_ROTATION_SLOWDOWN) if judged else None,
                 "note": None if judged else "timed on the pure-torch reference: not the kernel's cost; goal not judged"},
    }  # fmt: skip


# -- the study ---------------------------------------------------------------------------------------


def _positive(args: argparse.Namespace, name: str, minimum: int = 1) -> int:
    value = getattr(args, name)
    if value < minimum:
        raise QuantInputError(f"--{name}={value}: must be >= {minimum}")
    return value


def _models(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if names in ([], ["none"]):
        return []
    from ..zoo import recipe_names

    known = recipe_names()
    unknown = [name for name in names if name not in known]
    if unknown:
        raise QuantInputError(f"--models: unknown recipe {', '.join(map(repr, unknown))}; known: {', '.join(known)}, or none")
    return names


def run(args: argparse.Namespace) -> dict:
    """Run the error study (``args`` already holds its defaults); returns the JSON report, writes PNG/Markdown when asked."""
    bits_list = parse_bits(args.bits)
    for name in ("train_steps", "timing_numel"):
        _positive(args, name, minimum=0)
    for name in ("max_numel", "synthetic_numel", "seeds", "repeats"):
        _positive(args, name)
    if args.bucket_size is not None:
        _positive(args, "bucket_size")
    models = _models(args.models)
    kinds: list[TensorKind] = []
    captured = []
    for recipe_name in models:
        logger.info("bench quant error: capturing %s (%d steps)", recipe_name, args.train_steps)
        recipe_kinds, info = capture_recipe_tensors(recipe_name, args.train_steps, args.max_numel)
        kinds += recipe_kinds
        captured.append(info)
    kinds += synthetic_kinds(args.synthetic_numel)
    backend = backend_name(_backend.kernels_for("cpu"))
    rows = measure_errors(kinds, bits_list, args.bucket_size, args.seeds)
    report: dict = {
        "benchmark": "quant",
        "study": "error",
        "backend": backend,
        "requested_backend": _backend.requested_backend(),
        "bits": bits_list,
        "bucket_size_override": args.bucket_size,
        "roundings": list(ROUNDINGS),
        "rotations": list(ROTATIONS),
        "seeds": args.seeds,
        "error_metric": "relative MSE sum((x_hat - x)^2) / sum(x^2) of one encode/decode round trip, mean over seeds",
        "captured": captured,
        "kinds": {kind.name: kind.describe() for kind in kinds},
        "errors": rows,
        "summary": summarize(rows),
        "timing": time_rotation(args.timing_numel, args.repeats) if args.timing_numel else None,
    }
    png = png_path(args)
    if png:
        plot(report, png)
        report["png"] = png
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(markdown(report))
        report["markdown"] = args.markdown
    return report


# -- figure and tables -------------------------------------------------------------------------------


def plot(report: dict, png: str) -> None:
    """One panel per tensor kind (relative MSE against bits, log scale) and one of the timing ratios."""
    plt = headless_pyplot()
    kinds = list(report["kinds"])
    panels = len(kinds) + (report["timing"] is not None)
    columns = min(4, panels)
    rows_count = math.ceil(panels / columns)
    fig, axes = plt.subplots(rows_count, columns, figsize=(4.2 * columns, 3.4 * rows_count), squeeze=False)
    flat_axes = list(axes.flat)
    styles = {("stochastic", "none"): ("C0", "-"), ("stochastic", "hadamard"): ("C0", "--"),
              ("nearest", "none"): ("C1", "-"), ("nearest", "hadamard"): ("C1", "--")}  # fmt: skip
    for ax, kind in zip(flat_axes, kinds, strict=False):
        rows = [row for row in report["errors"] if row["kind"] == kind]
        for (rounding, rotation), (color, line) in styles.items():
            points = sorted((row["bits"], row["rel_mse"][rotation]) for row in rows if row["rounding"] == rounding)
            ax.plot(*zip(*points, strict=True), color=color, linestyle=line, marker="o", label=f"{rounding}, {rotation}")
        ax.set_yscale("log")
        ax.set_xticks(report["bits"])
        ax.set_xlabel("bits")
        ax.set_ylabel("relative MSE")
        ax.set_title(kind, fontsize=9)
        ax.grid(alpha=0.3)
    flat_axes[0].legend(fontsize=7)
    if report["timing"] is not None:
        ax = flat_axes[len(kinds)]
        timing = report["timing"]
        names = [f"{op} {row['bits']}b/B{row['bucket_size']}" for row in timing["rows"] for op in ("encode", "decode")]
        ratios = [row[f"{op}_cpu_ratio"] for row in timing["rows"] for op in ("encode", "decode")]
        ax.bar(range(len(ratios)), ratios, color=["C2" if name.startswith("encode") else "C4" for name in names])
        ax.axhline(timing["goal"]["max_encode_ratio"], color="k", linestyle="--", label="goal (encode)")
        ax.set_xticks(range(len(names)), names, rotation=30, fontsize=7)
        ax.set_ylabel("CPU time with / without rotation")
        ax.set_title(f"1 thread, {timing['backend']} backend, {timing['rows'][0]['numel']:,} values", fontsize=9)
        ax.legend(fontsize=7)
    for ax in flat_axes[panels:]:
        ax.axis("off")
    fig.suptitle(f"Round-trip error with and without Hadamard rotation (mean of {report['seeds']} seeds)")
    fig.tight_layout()
    save_figure(fig, png)


def _sci(value: float | None) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:.3g}"


def markdown(report: dict) -> str:
    """The error table (stochastic and nearest side by side), the summary and the timing table."""
    lines = [
        f"Relative MSE `sum((x_hat - x)^2) / sum(x^2)` of one round trip, mean of {report['seeds']} seeds "
        f"({report['backend']} backend); ratio = none / hadamard (above 1: rotation helps).",
        "",
        "| tensors | bits | bucket | stochastic, none | stochastic, hadamard | ratio | nearest, none | nearest, hadamard | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by_key = {(row["kind"], row["bits"], row["rounding"]): row for row in report["errors"]}
    for kind in report["kinds"]:
        for bits in report["bits"]:
            cells = []
            for rounding in ROUNDINGS:
                row = by_key[(kind, bits, rounding)]
                cells += [_sci(row["rel_mse"]["none"]), _sci(row["rel_mse"]["hadamard"]), _sci(row["ratio_none_over_hadamard"])]
            bucket = f"{row['bucket_size']} {row['meta_dtype']}"
            lines.append(f"| {kind} | {bits} | {bucket} | " + " | ".join(cells) + " |")
    lines += ["", "| bits | rounding | kinds | geometric mean ratio | min | max |", "|---|---|---|---|---|---|"]
    for entry in report["summary"]:
        lines.append(f"| {entry['bits']} | {entry['rounding']} | {entry['kinds']} | {entry['geomean_ratio']:.3g} | "
                     f"{entry['min_ratio']:.3g} | {entry['max_ratio']:.3g} |")  # fmt: skip
    timing = report["timing"]
    if timing is not None:
        goal = timing["goal"]
        verdict = {True: "met", False: "missed", None: goal["note"]}[goal["met"]]
        lines += ["", f"One thread, {timing['backend']} backend, median of {timing['repeats']} interleaved runs, thread CPU "
                      f"time (wall-clock ratio in brackets); goal: encode with rotation <= {goal['max_encode_ratio']:g}x "
                      f"encode without ({verdict}).", "",
                  "| payload | values | encode none (ms) | encode hadamard (ms) | ratio | decode none (ms) | decode hadamard (ms) | ratio |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for row in timing["rows"]:
            cells = []
            for op in ("encode", "decode"):
                cpu = row[f"{op}_cpu_s"]
                cells += [f"{cpu['none'] * 1e3:.1f}", f"{cpu['hadamard'] * 1e3:.1f}",
                          f"{row[f'{op}_cpu_ratio']:.2f} ({row[f'{op}_ratio']:.2f})"]  # fmt: skip
            lines.append(f"| {row['bits']}-bit B{row['bucket_size']} {row['meta_dtype']} | {row['numel']:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
