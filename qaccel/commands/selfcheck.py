"""``qaccel selfcheck``: round-trip the codecs on every available backend against the reference."""

from __future__ import annotations

import argparse

import torch

from .. import quant
from ..quant import _backend, reference
from ._output import emit


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("selfcheck", help="check every kernel backend against the pure-torch reference")
    parser.add_argument("--numel", type=int, default=1 << 20, help="elements of the test tensor")
    parser.set_defaults(func=run)


def _check_backend(kernels, x: torch.Tensor, bits: int, bucket: int, seed: int) -> dict:
    expected = reference.quantize_buckets(x, bits, bucket, False, seed, torch.float32)
    got = kernels.quantize_buckets(x, bits, bucket, False, seed, torch.float32)
    codes_equal = all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(expected, got, strict=True))
    out_ref = reference.dequantize_into(*expected, bits, bucket, torch.empty_like(x), False)
    out_got = kernels.dequantize_into(*got, bits, bucket, torch.empty_like(x), False)
    return {"bits": bits, "bucket_size": bucket, "codes_identical": codes_equal, "values_identical": torch.equal(out_ref.cpu(), out_got.cpu())}


def run(args: argparse.Namespace) -> int:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.numel, generator=generator)
    checks = {}
    for name, kernels in _backend.available_kernels(x.device).items():
        checks[name] = [_check_backend(kernels, x, bits, bucket, 1234 + bits) for bits in (2, 4, 8) for bucket in (128, 1024)]
    q = quant.quantize(x, 8, seed=1)
    error = (quant.dequantize(q) - x).abs().max().item()
    ok = all(c["codes_identical"] and c["values_identical"] for rows in checks.values() for c in rows)
    emit({"selfcheck": {"ok": ok, "backends": checks, "w8_max_abs_error": error, "w8_nbytes": q.nbytes, "numel": args.numel}})
    return 0 if ok else 1
