"""``qaccel selfcheck``: every native kernel backend checked bit for bit against the pure-torch reference.

The reference (:mod:`qaccel.quant.reference`) is the specification, so it is the baseline of every
comparison and never a check of its own. Each native backend that loads for this machine (the C++ kernels;
the CUDA kernels where a GPU is visible) runs the codec operations on the same inputs as the reference:
quantize (codes and bucket metadata, stochastic and nearest rounding, fp32 and bf16 metadata), dequantize
(overwrite and accumulate), sign pack, sign unpack, and the fused 1-bit error feedback (worker and server
side: signs, scales and the updated error buffer). Any differing bit makes the command exit 1. A native
backend that does not load is listed with the reason (nothing to compare, exit 0).

``--build_only`` builds the native kernels this machine can use into ``QACCEL_CACHE_DIR`` and checks
nothing: a step for an image build or a node's set-up, so that the first training run does not pay
for the compile. A build that fails is exit 1 there, since the point is to have it.
"""

from __future__ import annotations

import argparse
import time
from types import ModuleType

import torch

from .. import quant
from ..quant import _backend, _native, reference
from ._output import emit

# (bits, bucket size, nearest rounding, metadata dtype)
_QUANT_CASES = [(bits, bucket, False, torch.float32) for bits in (2, 4, 8) for bucket in (128, 1024)] + [
    (4, 128, True, torch.bfloat16),
    (8, 1024, True, torch.float32),
]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("selfcheck", help="check every native kernel backend against the pure-torch reference")
    parser.add_argument("--numel", type=int, default=1 << 20, help="elements of the test tensor")
    parser.add_argument(
        "--build_only",
        action="store_true",
        help="build the native kernels this machine can use (C++; CUDA where a GPU is visible) into QACCEL_CACHE_DIR, "
        "check nothing; exit 1 if a build fails (an image build step)",
    )
    parser.set_defaults(func=run)


def _same(a: tuple | torch.Tensor, b: tuple | torch.Tensor) -> bool:
    pairs = zip(a, b, strict=True) if isinstance(a, tuple) else [(a, b)]
    return all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.cpu(), y.cpu()) for x, y in pairs)


def _check_backend(kernels: ModuleType, x: torch.Tensor) -> list[dict]:
    """Every codec operation of ``kernels`` against the reference on the same inputs."""
    checks = []
    for bits, bucket, nearest, meta in _QUANT_CASES:
        case = {"bits": bits, "bucket_size": bucket, "rounding": "nearest" if nearest else "stochastic", "meta_dtype": str(meta)}
        seed = 1234 + bits
        expected = reference.quantize_buckets(x, bits, bucket, nearest, seed, meta)
        got = kernels.quantize_buckets(x, bits, bucket, nearest, seed, meta)
        checks.append({"op": "quantize", **case, "identical": _same(expected, got)})
        for accumulate in (False, True):
            start = torch.linspace(-1.0, 1.0, x.numel(), device=x.device)
            want = reference.dequantize_into(*expected, bits, bucket, start.clone(), accumulate)
            have = kernels.dequantize_into(*expected, bits, bucket, start.clone(), accumulate)
            checks.append({"op": "dequantize", **case, "accumulate": accumulate, "identical": _same(want, have)})
    for chunks in (1, 4):
        n = x.numel() - x.numel() % chunks
        signs = reference.sign_pack(x[:n], chunks)
        checks.append({"op": "sign_pack", "chunks": chunks, "identical": _same(signs, kernels.sign_pack(x[:n], chunks))})
        scales = reference.chunk_rms(x[:n], chunks)
        want = reference.sign_unpack(signs, scales, n, torch.empty(n, device=x.device))
        have = kernels.sign_unpack(signs, scales, n, torch.empty(n, device=x.device))
        checks.append({"op": "sign_unpack", "chunks": chunks, "identical": _same(want, have)})
    return checks + _check_onebit(kernels, x)


def _check_onebit(kernels: ModuleType, x: torch.Tensor, world: int = 4) -> list[dict]:
    """The fused 1-bit error-feedback ops: signs, scales and the updated error buffer, both sides."""
    checks = []
    for chunks in (1, world):
        padded = x.numel() - x.numel() % (8 * world)
        error = torch.linspace(-0.5, 0.5, padded, device=x.device)
        values = x[: padded - 3]  # shorter than the buffer: the zero padding is compensated too
        want_error, have_error = error.clone(), error.clone()
        want = reference.onebit_encode(values, want_error, chunks)
        have = kernels.onebit_encode(values, have_error, chunks)
        checks.append({"op": "onebit_encode", "chunks": chunks, "identical": _same((*want, want_error), (*have, have_error))})
        numel = padded // world  # one rank's server chunk; the worker signs are the encoded rows
        signs, scales = want[0][: world * (numel // 8)], torch.linspace(0.5, 2.0, world, device=x.device)
        want_error, have_error = error[:numel].clone(), error[:numel].clone()
        server_chunks = 1 if chunks == 1 else 2
        want = reference.onebit_server(signs, scales, want_error, server_chunks)
        have = kernels.onebit_server(signs, scales, have_error, server_chunks)
        checks.append({"op": "onebit_server", "chunks": server_chunks, "identical": _same((*want, want_error), (*have, have_error))})
    return checks


def _native_for(device: torch.device) -> tuple[ModuleType | None, str | None]:
    """The native kernels of ``device`` honouring ``QACCEL_KERNELS``, or (None, why not)."""
    requested = _backend.requested_backend()
    if requested == "reference":
        return None, f"{_backend.ENV_NAME}=reference selects the reference only"
    name = device.type
    if requested == "auto":
        return _native.try_load(name)
    if requested != name:
        return None, f"{_backend.ENV_NAME}={requested} selects another device's kernels"
    return _backend.kernels_for(device), None  # explicit: a failed build raises here


def _build_only() -> int:
    """Build (or find already built) each native backend this machine can use, honouring ``QACCEL_KERNELS``."""
    requested = _backend.requested_backend()
    backends: dict[str, dict] = {}
    for name in _native.NATIVE_BACKENDS:
        if requested not in ("auto", name):
            backends[name] = {"role": "not built", "reason": f"{_backend.ENV_NAME}={requested}"}
        elif name == "cuda" and not torch.cuda.is_available():
            # the CUDA build targets the visible GPU's architecture (part of its build name)
            backends[name] = {"role": "not built", "reason": "no CUDA device is available"}
        else:
            start = time.perf_counter()
            kernels, reason = _native.try_load(name)
            seconds = round(time.perf_counter() - start, 1)
            if kernels is None:
                backends[name] = {"role": "failed", "reason": reason, "seconds": seconds}
            else:
                backends[name] = {"role": "built", "build_dir": str(_native.cache_root() / _native.build_name(name)), "seconds": seconds}
    ok = all(entry["role"] != "failed" for entry in backends.values())
    emit({"selfcheck": {"ok": ok, "build_only": True, "cache_dir": str(_native.cache_root()), "backends": backends}})
    return 0 if ok else 1


def run(args: argparse.Namespace) -> int:
    if args.build_only:
        return _build_only()
    generator = torch.Generator().manual_seed(0)
    x_cpu = torch.randn(args.numel, generator=generator)
    x_cpu[:: max(1, args.numel // 7)] = 0.0  # exact zeros: the sign codec maps them to +1
    backends: dict[str, dict] = {"reference": {"role": "baseline"}}
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    for device in devices:
        kernels, reason = _native_for(device)
        if kernels is None:
            backends[device.type] = {"role": "not checked", "reason": reason}
            continue
        checks = _check_backend(kernels, x_cpu.to(device))
        backends[device.type] = {"role": "checked", "ok": all(c["identical"] for c in checks), "checks": checks}
    if not torch.cuda.is_available():
        backends["cuda"] = {"role": "not checked", "reason": "no CUDA device is available"}
    checked = sorted(name for name, entry in backends.items() if entry["role"] == "checked")
    ok = all(backends[name]["ok"] for name in checked)
    q = quant.quantize(x_cpu, 8, seed=1)
    error = (quant.dequantize(q) - x_cpu).abs().max().item()
    emit(
        {
            "selfcheck": {
                "ok": ok,
                "baseline": "reference",
                "checked": checked,
                "backends": backends,
                "w8_max_abs_error": error,
                "w8_nbytes": q.nbytes,
                "numel": args.numel,
            }
        }
    )
    return 0 if ok else 1
