"""Public codec functions: argument validation, then dispatch to the chosen backend."""

from __future__ import annotations

import math

import torch

from . import _backend
from ._rng import normalize_seed
from ._types import META_DTYPES, ROUNDINGS, QuantizedTensor, SignCompressed

__all__ = ["quantize", "dequantize", "sign_compress", "sign_decompress"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_float_tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name}.dtype={x.dtype}: must be one of float32, bfloat16, float16")
    return x


def _check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r}: must be an int")
    if value < low or (high is not None and value > high):
        allowed = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name}={value}: must be an int in {allowed}")
    return value


def _resolve_meta_dtype(meta_dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(meta_dtype, str):
        if meta_dtype not in META_DTYPES:
            raise ValueError(f"meta_dtype={meta_dtype!r}: must be one of {', '.join(META_DTYPES)}")
        return META_DTYPES[meta_dtype]
    if meta_dtype not in META_DTYPES.values():
        raise ValueError(f"meta_dtype={meta_dtype}: must be one of {', '.join(META_DTYPES)}")
    return meta_dtype


def quantize(
    x: torch.Tensor,
    bits: int,
    bucket_size: int = 1024,
    rounding: str = "stochastic",
    seed: int = 0,
    meta_dtype: torch.dtype | str = torch.float32,
) -> QuantizedTensor:
    """Quantize ``x`` (any shape, read flat) to ``bits``-bit codes with per-bucket min/scale.

    Args:
        x: fp32, bf16 or fp16 tensor on any device.
        bits: code width in [2, 8].
        bucket_size: elements per bucket (>= 1); the last bucket may be shorter. Smaller buckets
            give finer grids at the price of more metadata on the wire.
        rounding: ``"stochastic"`` (unbiased, ``|x_hat - x| < scale``) or ``"nearest"``
            (``|x_hat - x| <= scale / 2``, biased).
        seed: unsigned 64-bit seed of the counter-based rounding noise; the same input and seed
            give the same codes on every backend and device.
        meta_dtype: ``float32`` (default, exact ``lo``) or ``bfloat16`` (half the metadata bytes;
            ``lo`` rounded down, ``scale`` rounded up so the grid still covers the bucket).

    Returns:
        A :class:`QuantizedTensor`; its ``nbytes`` is ``bits*ceil(n/8) + 2*meta_size*ceil(n/B)``.

    Raises:
        TypeError / ValueError naming the bad argument.

    Example::

        q = quantize(torch.randn(4096), bits=4, bucket_size=128, seed=7)
        x_hat = dequantize(q)
    """
    x = _check_float_tensor("x", x)
    _check_int("bits", bits, 2, 8)
    _check_int("bucket_size", bucket_size, 1)
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r}: must be one of {', '.join(ROUNDINGS)}")
    seed = normalize_seed(seed)
    meta = _resolve_meta_dtype(meta_dtype)
    flat = x.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    kernels = _backend.kernels_for(flat.device)
    codes, lo, scale = kernels.quantize_buckets(flat, bits, bucket_size, rounding == "nearest", seed, meta)
    return QuantizedTensor(
        codes=codes,
        lo=lo,
        scale=scale,
        numel=flat.numel(),
        bits=bits,
        bucket_size=bucket_size,
        dtype=x.dtype,
        shape=x.shape,
    )


def dequantize(q: QuantizedTensor, out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """Reconstruct ``q``; returns a new fp32 tensor of ``q.shape``, or fills/adds into ``out``.

    Args:
        q: the result of :func:`quantize`.
        out: optional contiguous fp32/bf16/fp16 tensor with ``q.numel`` elements (any shape).
        accumulate: add the decoded values to ``out`` (sum computed in fp32) instead of
            overwriting it; requires ``out``.

    Returns:
        ``out`` if given, else a new fp32 tensor of shape ``q.shape``.
    """
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"q: expected a QuantizedTensor, got {type(q).__name__}")
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True: requires an out tensor to add into")
        out = torch.empty(q.shape, dtype=torch.float32, device=q.codes.device)
    _check_float_tensor("out", out)
    if out.numel() != q.numel:
        raise ValueError(f"out.numel()={out.numel()}: must equal q.numel={q.numel}")
    if not out.is_contiguous():
        raise ValueError("out: must be contiguous")
    if out.device != q.codes.device:
        raise ValueError(f"out.device={out.device}: must equal the codes' device {q.codes.device}")
    kernels = _backend.kernels_for(out.device)
    kernels.dequantize_into(q.codes, q.lo, q.scale, q.bits, q.bucket_size, out.view(-1), accumulate)
    return out


def sign_compress(x: torch.Tensor, chunks: int = 1) -> SignCompressed:
    """1-bit compress ``x``: sign bits (``x >= 0`` is +1) and one RMS scale per equal chunk.

    Args:
        x: fp32/bf16/fp16 tensor; ``x.numel()`` must be divisible by ``chunks``.
        chunks: number of equal chunks, each with its own scale ``||x_c|| / sqrt(n_c)``.

    Returns:
        A :class:`SignCompressed` whose decoded value is ``scale_c * (+1 | -1)``.
    """
    x = _check_float_tensor("x", x)
    _check_int("chunks", chunks, 1)
    if x.numel() % chunks:
        raise ValueError(f"chunks={chunks}: must divide x.numel()={x.numel()}")
    flat = x.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    kernels = _backend.kernels_for(flat.device)
    return SignCompressed(
        signs=kernels.sign_pack(flat, chunks),
        scales=kernels.chunk_rms(flat, chunks),
        numel=flat.numel(),
        chunks=chunks,
        shape=x.shape,
    )


def sign_decompress(c: SignCompressed, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode a :class:`SignCompressed` into a new fp32 tensor of ``c.shape`` (or into ``out``)."""
    if not isinstance(c, SignCompressed):
        raise TypeError(f"c: expected a SignCompressed, got {type(c).__name__}")
    if out is None:
        out = torch.empty(c.shape, dtype=torch.float32, device=c.signs.device)
    if out.dtype != torch.float32 or out.numel() != c.numel or not out.is_contiguous():
        raise ValueError(
            f"out: must be a contiguous float32 tensor with {c.numel} elements, "
            f"got {out.dtype} with {out.numel()}"
        )
    expected = c.chunks * math.ceil(c.numel // c.chunks / 8) if c.numel else 0
    if c.signs.numel() != expected:
        raise ValueError(f"c.signs has {c.signs.numel()} bytes: expected {expected}")
    kernels = _backend.kernels_for(out.device)
    kernels.sign_unpack(c.signs, c.scales, c.numel, out.view(-1))
    return out
