"""Bit-exactness checks of the fused payload codecs against the pure-torch reference, shared by the CPU and CUDA tests.

``tests/unit/test_quant_payloads.py`` and ``test_quant_rotation.py`` run them on the C++ kernels,
``test_quant_rotation_cuda.py`` the same ones on a GPU. The oracle is ``qaccel.quant.reference``; results are
compared bit for bit (``bits_equal`` compares floats through their integer views, so NaN payloads count too).
"""

from __future__ import annotations

import pytest
import torch

from qaccel.quant import PayloadSpec, reference

__all__ = [
    "BITS", "BUCKETS", "DTYPES", "INT_VIEW", "SEGMENTS", "bits_equal", "bucket_id", "check_bits_and_bucket",
    "check_dtypes", "check_huge_magnitudes", "check_matches_reference", "check_zero_buckets", "dtype_grid",
    "payload_chunks", "payload_seeds",
]  # fmt: skip

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (floats compared as integers, so NaNs with equal payloads are equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        return torch.equal(a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype]))
    return torch.equal(a, b)


# Ragged lengths: a raw run, an empty segment, a one-element segment, short tails, and one segment
# longer than the C++ tile (32768 elements) so buckets straddle tiles.
SEGMENTS = ((1000, True), (37, False), (0, True), (2600, True), (5, False), (9, True), (1, True), (40000, True))


def payload_seeds(slots: int, segments: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-(2**63), 2**63 - 1, (slots, segments), generator=gen, dtype=torch.int64)


def payload_chunks(spec: PayloadSpec, slots: int, gen: torch.Generator, special: bool = True) -> torch.Tensor:
    """``slots`` chunks back to back: weight-like segments, NaN/Inf buckets, wide buckets, raw runs."""
    chunks = []
    for slot in range(slots):
        parts = []
        for index, (numel, quantized) in enumerate(spec.segments):
            part = torch.randn(numel, generator=gen) * 0.02 * (index + 1)
            if special and quantized and numel > 100:
                part[3 + slot] = float("nan")
                part[numel - 2] = float("inf") if slot % 2 else -float("inf")
                part[numel // 2] = 3.0e4  # a wide, finite bucket (fp16 holds it)
            if special and not quantized and numel > 10:
                part[slot] = -float("inf")
            parts.append(part)
        chunks.append(torch.cat(parts))
    return torch.cat(chunks).to(spec.elem_dtype)


def check_matches_reference(kernels, spec: PayloadSpec, slots: int, gen: torch.Generator, special: bool = True,
                             device: str = "cpu") -> torch.Tensor:
    """Encode (permuted, uneven offsets), decode into every output dtype, sum with several bases.

    ``kernels`` and the reference both run on ``device``; the seed table goes to decode and sum on
    the CPU or on ``device`` (either is allowed), to encode on the CPU.
    """
    src = torch.cat([torch.randn(3).to(spec.elem_dtype), payload_chunks(spec, slots, gen, special)]).to(device)
    offsets = [3 + spec.numel * s for s in reversed(range(slots))]
    seeds = payload_seeds(slots, len(spec.segments), gen)
    device_seeds = seeds.to(device)
    expected = torch.full((slots * spec.nbytes,), 0xAB, dtype=torch.uint8, device=device)
    got = torch.full_like(expected, 0xCD)  # different garbage: padding must be written
    reference.encode_payloads(src, spec, offsets, seeds, expected)
    kernels.encode_payloads(src, spec, offsets, seeds, got)
    assert torch.equal(expected, got), f"payload bytes differ at {(expected != got).nonzero().flatten()[:8].tolist()}"

    for index, out_dtype in enumerate(DTYPES):
        ref = torch.full((5 + slots * spec.numel,), 7.0, dtype=out_dtype, device=device)
        out = ref.clone()
        out_offsets = [5 + spec.numel * ((s + 1) % slots) for s in range(slots)]
        reference.decode_payloads(expected, spec, ref, out_offsets, seeds)
        kernels.decode_payloads(expected, spec, out, out_offsets, device_seeds if index % 2 else seeds)
        assert bits_equal(ref, out), f"decoded into {out_dtype} differs"

    for base_dtype, out_dtype in ((torch.float32, torch.float32), (spec.elem_dtype, spec.elem_dtype),
                                  (torch.float32, torch.bfloat16), (torch.float16, torch.float32)):  # fmt: skip
        base = (torch.randn(spec.numel, generator=gen) * 0.05).to(base_dtype).to(device)
        ref = torch.empty(spec.numel, dtype=out_dtype, device=device)
        out = torch.full_like(ref, 3.0)
        reference.sum_payloads(expected, spec, base, ref, seeds)
        kernels.sum_payloads(expected, spec, base, out, device_seeds)
        assert bits_equal(ref, out), f"sum base={base_dtype} out={out_dtype} differs"
        if base_dtype == out_dtype:  # in place, as the reduce-scatter sums into its own chunk
            aliased = base.clone()
            kernels.sum_payloads(expected, spec, aliased, aliased, seeds)
            assert bits_equal(ref, aliased), "sum into base itself differs"
    return expected


# -- C++ (or CUDA) == reference, bit for bit -------------------------------------------------------

BITS = [2, 3, 4, 8]
# Power-of-two buckets (128, 1024), an odd one (100 = 64+32+4) and several blocks (3000).
BUCKETS = [128, 1024, 100, 3000]


def bucket_id(bucket: int) -> str:
    return f"B{bucket}"


def check_bits_and_bucket(kernels, bits: int, bucket: int, device: str = "cpu") -> None:
    """Element and metadata dtypes and roundings vary with the case (every combination: ``dtype_grid``)."""
    case = bits * 7 + bucket
    elem_dtype = DTYPES[case % 3]
    meta = (torch.float32, torch.bfloat16)[case % 2]
    rounding = ("stochastic", "nearest")[(case // 2) % 2]
    spec = PayloadSpec(SEGMENTS, bits, bucket, meta, rounding, elem_dtype, rotation="hadamard")
    check_matches_reference(kernels, spec, 3, torch.Generator().manual_seed(case), device=device)


# Applied in this order, so test ids read bucket-rounding-meta-elem (as stacked decorators would give).
_DTYPE_GRID = (
    pytest.mark.parametrize("bucket", [64, 24], ids=bucket_id),
    pytest.mark.parametrize("rounding", ["stochastic", "nearest"]),
    pytest.mark.parametrize("meta", [torch.float32, torch.bfloat16], ids=["meta32", "meta16"]),
    pytest.mark.parametrize("elem_dtype", DTYPES, ids=["fp32", "bf16", "fp16"]),
)


def dtype_grid(test):
    """Parametrize ``test`` over every bucket (64, 24), rounding, metadata and element dtype."""
    for mark in _DTYPE_GRID:
        test = mark(test)
    return test


def check_dtypes(kernels, elem_dtype: torch.dtype, meta: torch.dtype, rounding: str, bucket: int,
                  device: str = "cpu") -> None:  # fmt: skip
    segments = ((700, True), (3, False), (130, True), (7, True))
    spec = PayloadSpec(segments, 4, bucket, meta, rounding, elem_dtype, rotation="hadamard")
    check_matches_reference(kernels, spec, 2, torch.Generator().manual_seed(bucket + len(str(meta))), device=device)


def check_huge_magnitudes(kernels, device: str = "cpu") -> None:
    """Rotated values that overflow fp32 (non-finite buckets) and bf16 grids that round past fp32's max."""
    segments = ((4096, True), (300, True))
    for meta in (torch.float32, torch.bfloat16):
        spec = PayloadSpec(segments, 3, 256, meta, "stochastic", torch.float32, rotation="hadamard")
        gen = torch.Generator().manual_seed(5)
        src = torch.randn(2 * spec.numel, generator=gen) * 1e37
        src[:256] *= 30.0  # sums of 256 values near 3e38: |r| > fp32 max, the bucket turns non-finite
        src[1000] = 3.4e38
        src[2000:2256] = -3.3e38  # a bucket near -max: bf16 lo rounds down past it
        src = src.to(device)
        seeds = payload_seeds(2, len(segments), gen)
        expected = torch.empty(2 * spec.nbytes, dtype=torch.uint8, device=device)
        got = torch.empty_like(expected)
        reference.encode_payloads(src, spec, [0, spec.numel], seeds, expected)
        kernels.encode_payloads(src, spec, [0, spec.numel], seeds, got)
        assert torch.equal(expected, got)
        ref, out = torch.empty(2 * spec.numel, device=device), torch.empty(2 * spec.numel, device=device)
        reference.decode_payloads(expected, spec, ref, [0, spec.numel], seeds)
        kernels.decode_payloads(expected, spec, out, [0, spec.numel], seeds)
        assert bits_equal(ref, out)
        assert ref.isnan().any() and ref.isfinite().any()


def check_zero_buckets(kernels, device: str = "cpu") -> None:
    """All-zero buckets rotate to mixed +-0: same codes and scales, lo equal as a value, same decode.

    The sign of a zero min is unspecified (reference module docstring, step 3): torch's amin keeps
    whichever zero its reduction meets first, the C++ and CUDA kernels the smaller key (-0.0).
    """
    segments = ((1024, True), (640, True))
    spec = PayloadSpec(segments, 4, 128, torch.float32, "stochastic", torch.float32, rotation="hadamard")
    src = torch.zeros(spec.numel)
    src[1024 + 128 : 1024 + 256] = torch.randn(128, generator=torch.Generator().manual_seed(0))
    src = src.to(device)
    seeds = torch.tensor([[11, -7]], dtype=torch.int64)
    expected = torch.empty(spec.nbytes, dtype=torch.uint8, device=device)
    got = torch.empty_like(expected)
    reference.encode_payloads(src, spec, [0], seeds, expected)
    kernels.encode_payloads(src, spec, [0], seeds, got)
    meta = slice(spec.meta_offset, spec.meta_offset + 4 * spec.num_buckets)
    assert torch.equal(expected[: spec.meta_offset], got[: spec.meta_offset]), "codes differ"
    assert torch.equal(expected[meta.stop :], got[meta.stop :]), "scales differ"
    assert torch.equal(expected[meta].view(torch.float32), got[meta].view(torch.float32)), "lo differs in value"
    for blob in (expected, got):
        ref, out = torch.empty(spec.numel, device=device), torch.empty(spec.numel, device=device)
        reference.decode_payloads(blob, spec, ref, [0], seeds)
        kernels.decode_payloads(blob, spec, out, [0], seeds)
        assert bits_equal(ref, out)
        assert torch.equal(out[:1024], torch.zeros(1024, device=device))
