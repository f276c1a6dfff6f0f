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
  the study times at most 2**20 values (``_quant_error_timing``) and leaves the goal unjudged.

Backends are bit-identical, so the errors do not depend on which one ``QACCEL_KERNELS`` picks; the
report records it.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from ..quant import _backend
from ._figures import png_path
from ._quant_error_measure import (
    ROTATIONS,
    ROUNDINGS,
    SAMPLE_CHUNK,
    TensorKind,
    capture_recipe_tensors,
    codec_buckets,
    measure_errors,
    relative_mse,
    roundtrip,
    sample_chunks,
    segment_seeds,
    summarize,
    synthetic_kinds,
)
from ._quant_error_report import markdown, plot
from ._quant_error_timing import GOAL_ROTATION_SLOWDOWN, backend_name, time_rotation
from ._quant_inputs import QuantInputError, parse_bits

logger = logging.getLogger(__name__)

# the study's flags and its run live here; the names after "markdown" are re-exported from the modules the
# measurement, the timing and the report moved to
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
    "plot",
    "segment_seeds",
    "sample_chunks",
    "codec_buckets",
    "measure_errors",
    "summarize",
    "backend_name",
    "time_rotation",
    "ROUNDINGS",
    "ROTATIONS",
    "SAMPLE_CHUNK",
    "GOAL_ROTATION_SLOWDOWN",
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
