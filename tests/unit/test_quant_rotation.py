"""Hadamard bucket rotation of the fused payload codecs (``PayloadSpec(rotation="hadamard")``).

Oracles:
- the C++ kernels against the pure-torch reference, bit for bit (payload bytes, decoded values and
  sums with NaN bits), over bit widths, power-of-two, odd, multi-block and long buckets, element,
  output and metadata dtypes, both roundings, raw and ragged segments, NaN/Inf buckets, slots and
  thread counts;
- the reference against plain torch: an explicit Sylvester Hadamard matrix times the signs of
  ``_rng`` (a pure-Python hash here), orthogonality, the per-segment construction of a payload, and
  the error it is meant to cut (heavy-tailed data).
"""

from __future__ import annotations

import math

import pytest
import torch

from qaccel.quant import PayloadSpec, _payload, decode_payloads, encode_payloads, reference, sum_payloads
from qaccel.quant._rng import counter_hash, rotation_signs
from qaccel.quant._types import ROTATION_MAX_BLOCK, rotation_blocks
from tests._codec_checks import (
    BITS,
    BUCKETS,
    bits_equal,
    bucket_id,
    check_bits_and_bucket,
    check_dtypes,
    check_huge_magnitudes,
    check_matches_reference,
    check_zero_buckets,
    dtype_grid,
    payload_chunks,
    payload_seeds,
)


@pytest.mark.parametrize("bucket", [*BUCKETS, 5000], ids=bucket_id)
@pytest.mark.parametrize("bits", BITS)
def test_cpu_matches_reference(cpu_kernels, bits, bucket):
    """The shared buckets and a long one (> 4096)."""
    check_bits_and_bucket(cpu_kernels, bits, bucket)


@dtype_grid
def test_cpu_matches_reference_dtypes(cpu_kernels, elem_dtype, meta, rounding, bucket):
    check_dtypes(cpu_kernels, elem_dtype, meta, rounding, bucket)


@pytest.mark.parametrize("bucket", [1, 2, 5, 8, 16, 31, 1000], ids=bucket_id)
def test_cpu_matches_reference_small_and_odd_blocks(cpu_kernels, bucket):
    """Blocks of 1..16 elements (the scalar butterflies) and every block length up to 512 (B1000)."""
    segments = ((1003, True), (17, True))
    spec = PayloadSpec(segments, 5, bucket, torch.float32, "stochastic", torch.float32, rotation="hadamard")
    check_matches_reference(cpu_kernels, spec, 2, torch.Generator().manual_seed(bucket), special=False)


def test_cpu_matches_reference_huge_magnitudes(cpu_kernels):
    check_huge_magnitudes(cpu_kernels)


def test_zero_buckets(cpu_kernels):
    check_zero_buckets(cpu_kernels)


def test_thread_count_does_not_change_results(cpu_kernels):
    segments = ((100_000, True), (77, False), (65_537, True))
    previous = torch.get_num_threads()
    try:
        for bucket in (128, 3000, 6000):
            spec = PayloadSpec(segments, 4, bucket, torch.bfloat16, "stochastic", torch.float32, rotation="hadamard")
            gen = torch.Generator().manual_seed(bucket)
            src = payload_chunks(spec, 3, gen)
            seeds = payload_seeds(3, len(segments), gen)
            offsets = [0, spec.numel, 2 * spec.numel]
            results = []
            for count in (1, 2):
                torch.set_num_threads(count)
                blob = torch.empty(3 * spec.nbytes, dtype=torch.uint8)
                cpu_kernels.encode_payloads(src, spec, offsets, seeds, blob)
                decoded = torch.empty(3 * spec.numel)
                cpu_kernels.decode_payloads(blob, spec, decoded, offsets, seeds)
                total = torch.empty(spec.numel)
                cpu_kernels.sum_payloads(blob, spec, src[: spec.numel], total, seeds)
                results.append((blob, decoded, total))
            assert torch.equal(results[0][0], results[1][0])
            assert bits_equal(results[0][1], results[1][1])
            assert bits_equal(results[0][2], results[1][2])
    finally:
        torch.set_num_threads(previous)


def test_public_calls_use_the_seeds(cpu_kernels):
    """The public API on this machine's default backend: same bytes and values as the reference."""
    spec = PayloadSpec(((3000, True), (5, False)), 4, 1024, torch.float32, "stochastic", torch.float32, "hadamard")
    gen = torch.Generator().manual_seed(1)
    src = payload_chunks(spec, 2, gen, special=False)
    seeds = payload_seeds(2, 2, gen)
    expected, blob = torch.empty(2 * spec.nbytes, dtype=torch.uint8), torch.empty(2 * spec.nbytes, dtype=torch.uint8)
    reference.encode_payloads(src, spec, [0, spec.numel], seeds, expected)
    encode_payloads(src, spec, [0, spec.numel], seeds, blob)
    assert torch.equal(expected, blob)
    ref, out = torch.empty(2 * spec.numel), torch.empty(2 * spec.numel)
    reference.decode_payloads(blob, spec, ref, [0, spec.numel], seeds)
    decode_payloads(blob, spec, out, [0, spec.numel], seeds)
    assert bits_equal(ref, out)
    base = torch.randn(spec.numel, generator=gen)
    reference.sum_payloads(blob, spec, base, ref[: spec.numel], seeds)
    sum_payloads(blob, spec, base, out[: spec.numel], seeds)
    assert bits_equal(ref, out)


# -- the reference against plain torch -----------------------------------------------------------------


def _lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _python_signs(seed: int, numel: int) -> torch.Tensor:
    """``_rng``'s specification, in Python integers: sign = -1 where bit 0 of hash(seed, i) is set."""
    seed &= (1 << 64) - 1
    signs = []
    for i in range(numel):
        key = (seed & 0xFFFFFFFF) ^ _lowbias32(((seed >> 32) + (i >> 32)) & 0xFFFFFFFF)
        signs.append(-1.0 if _lowbias32((i & 0xFFFFFFFF) ^ key) & 1 else 1.0)
    return torch.tensor(signs, dtype=torch.float64)


def _sylvester(length: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < length:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)])
    return h


def _explicit_rotation(x: torch.Tensor, bucket: int, seed: int) -> torch.Tensor:
    """Block-diagonal H_b D / sqrt(b) per bucket, as float64 matrices (blocks: rotation_blocks)."""
    xd = x.double() * _python_signs(seed, x.numel())
    out = torch.empty_like(xd)
    for start in range(0, x.numel(), bucket):
        offset = start
        for block in rotation_blocks(min(bucket, x.numel() - start)):
            out[offset : offset + block] = _sylvester(block) @ xd[offset : offset + block] / math.sqrt(block)
            offset += block
    return out


def test_rotation_signs_are_bit_0_of_the_rounding_hash():
    for seed in (0, 1, 2**64 - 1, 0x123456789ABCDEF):
        assert torch.equal(rotation_signs(seed, 3000), _python_signs(seed, 3000))
        assert torch.equal(rotation_signs(seed, 3000), 1.0 - 2.0 * (counter_hash(seed, 3000) & 1).double())
    share = (rotation_signs(9, 100_000) < 0).double().mean().item()
    assert abs(share - 0.5) < 0.01


@pytest.mark.parametrize("bucket,numel", [(128, 128), (1024, 2048), (256, 300), (100, 250), (3000, 3000)])
def test_reference_rotation_is_the_explicit_matrix(bucket, numel):
    """Sylvester H times the signs of the spec, per block, equals the butterflies to fp32 rounding."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(bucket))
    seed = 0xDEADBEEF12345678
    rotated = reference.hadamard_rotate(x, bucket, seed)
    explicit = _explicit_rotation(x, bucket, seed)
    assert rotated.dtype == torch.float32
    # The fp32 result is the float64 value rounded once (half an ulp), plus float64 summation noise.
    ulp = torch.finfo(torch.float32).eps * explicit.abs()
    assert ((rotated.double() - explicit).abs() <= ulp + 1e-12).all()


def test_one_hot_block_gives_the_sign_and_the_normalization():
    """Rotating e_i: every output of its block is +-d_i / sqrt(b); element 0 (an all-ones row) is d_i / sqrt(b)."""
    block, seed = 64, 77
    signs = _python_signs(seed, block)
    for i in (0, 5, 63):
        x = torch.zeros(block)
        x[i] = 1.0
        rotated = reference.hadamard_rotate(x, block, seed).double()
        assert torch.equal(rotated.abs(), torch.full((block,), 1.0 / math.sqrt(block)).float().double())
        assert rotated[0].item() == pytest.approx(signs[i].item() / math.sqrt(block), rel=1e-7)


@pytest.mark.parametrize("bucket", [128, 100, 1024, 5000])
def test_reference_rotation_is_orthogonal(bucket):
    x = torch.randn(12_345, generator=torch.Generator().manual_seed(bucket)) * 3.0
    rotated = reference.hadamard_rotate(x, bucket, 42)
    for start in range(0, x.numel(), bucket):  # each bucket keeps its norm
        a, b = x[start : start + bucket].double(), rotated[start : start + bucket].double()
        assert torch.linalg.vector_norm(b).item() == pytest.approx(torch.linalg.vector_norm(a).item(), rel=1e-6)
    back = reference.hadamard_rotate(rotated, bucket, 42, inverse=True)
    assert torch.allclose(back, x, rtol=0, atol=1e-5)
    assert not torch.allclose(rotated, x, atol=1e-3)
    other_seed = reference.hadamard_rotate(rotated, bucket, 43, inverse=True)
    assert not torch.allclose(other_seed, x, atol=1e-3)


def _per_segment_payload(src: torch.Tensor, spec: PayloadSpec, seeds: list[int]) -> torch.Tensor:
    """One payload built from quantize_buckets per segment (on the rotated segment when rotated)."""
    blob = torch.zeros(spec.nbytes, dtype=torch.uint8)
    meta = spec.meta_itemsize * spec.num_buckets
    for index, (numel, quantized) in enumerate(spec.segments):
        segment = src[spec.elem_offsets[index] :][:numel]
        if not quantized:
            start = spec.raw_offsets[index]
            blob[start : start + numel * spec.elem_itemsize] = segment.view(torch.uint8)
            continue
        if spec.rotated:
            segment = reference.hadamard_rotate(segment, spec.bucket_size, seeds[index])
        codes, lo, scale = reference.quantize_buckets(
            segment, spec.bits, spec.bucket_size, spec.nearest, seeds[index], spec.meta_dtype
        )
        blob[spec.code_offsets[index] :][: codes.numel()] = codes
        first = spec.meta_offset + spec.bucket_offsets[index] * spec.meta_itemsize
        blob[first:][: lo.numel() * spec.meta_itemsize] = lo.view(torch.uint8)
        blob[first + meta :][: scale.numel() * spec.meta_itemsize] = scale.view(torch.uint8)
    return blob


@pytest.mark.parametrize("rotation", ["none", "hadamard"])
def test_payload_is_quantize_of_each_rotated_segment(cpu_kernels, rotation):
    """Rotated: the payload of quantize(hadamard_rotate(segment)); unrotated: the old bytes."""
    segments = ((1000, True), (7, False), (333, True))
    spec = PayloadSpec(segments, 3, 100, torch.bfloat16, "stochastic", torch.float32, rotation)
    assert spec.nbytes == PayloadSpec(segments, 3, 100, torch.bfloat16, "stochastic", torch.float32).nbytes
    assert spec.table()[_payload.H_ROTATION].item() == int(rotation == "hadamard")
    src = torch.randn(spec.numel, generator=torch.Generator().manual_seed(3))
    seeds = [5, 123, 2**64 - 9]  # one per segment; the raw one is unused
    table = torch.tensor([[seeds[0], seeds[1], seeds[2] - 2**64]], dtype=torch.int64)
    expected = _per_segment_payload(src, spec, seeds)
    for encode in (reference.encode_payloads, cpu_kernels.encode_payloads):
        blob = torch.empty(spec.nbytes, dtype=torch.uint8)
        encode(src, spec, [0], table, blob)
        assert torch.equal(blob, expected)
    plain = _per_segment_payload(src, PayloadSpec(segments, 3, 100, torch.bfloat16, "stochastic", torch.float32), seeds)
    assert torch.equal(expected, plain) == (rotation == "none")


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_rotation_lowers_the_error_on_heavy_tailed_data(bits):
    """Student-t (3 degrees of freedom) values: outliers stretch a bucket's grid; rotation spreads them."""
    numel, bucket = 1 << 16, 128
    gen = torch.Generator().manual_seed(bits)
    chi2 = torch.randn(3, numel, generator=gen).pow(2).sum(dim=0)
    x = torch.randn(numel, generator=gen) / (chi2 / 3).sqrt()  # Student-t, 3 degrees of freedom
    seeds = torch.tensor([[2024]], dtype=torch.int64)
    errors = {}
    for rotation in ("none", "hadamard"):
        spec = PayloadSpec(((numel, True),), bits, bucket, torch.float32, "stochastic", torch.float32, rotation)
        blob = torch.empty(spec.nbytes, dtype=torch.uint8)
        reference.encode_payloads(x, spec, [0], seeds, blob)
        decoded = torch.empty(numel)
        reference.decode_payloads(blob, spec, decoded, [0], seeds)
        errors[rotation] = (decoded - x).double().pow(2).mean().item()
    assert errors["hadamard"] < 0.8 * errors["none"], errors


def test_reference_decode_round_trip_is_close():
    """Decoding with the encode's seeds inverts the rotation: 8-bit error stays within the grid step."""
    spec = PayloadSpec(((5000, True),), 8, 1024, torch.float32, "nearest", torch.float32, "hadamard")
    x = torch.randn(spec.numel, generator=torch.Generator().manual_seed(8))
    seeds = torch.tensor([[99]], dtype=torch.int64)
    blob = torch.empty(spec.nbytes, dtype=torch.uint8)
    reference.encode_payloads(x, spec, [0], seeds, blob)
    decoded = torch.empty(spec.numel)
    reference.decode_payloads(blob, spec, decoded, [0], seeds)
    rotated = reference.hadamard_rotate(x, 1024, 99)
    step = (rotated.max() - rotated.min()).item() / 255
    assert (decoded - x).abs().max().item() < 8 * step  # worst element of an orthogonal image of <= step/2 errors
    assert torch.linalg.vector_norm(decoded - x).item() <= 0.5 * step * math.sqrt(spec.numel) * 1.01
    wrong = torch.empty(spec.numel)
    reference.decode_payloads(blob, spec, wrong, [0], seeds + 1)
    assert (wrong - x).abs().mean().item() > 0.3


def test_max_block_is_the_spec_constant():
    assert ROTATION_MAX_BLOCK == 1024
    assert rotation_blocks(100) == [64, 32, 4] and rotation_blocks(3000) == [1024, 1024, 512, 256, 128, 32, 16, 8]


# -- bad input -------------------------------------------------------------------------------------------


def test_rotated_decode_and_sum_need_seeds():
    spec = PayloadSpec(((20, True), (3, False)), 4, 8, torch.float32, "stochastic", torch.float32, "hadamard")
    blob = torch.zeros(2 * spec.nbytes, dtype=torch.uint8)
    out = torch.empty(2 * spec.numel)
    with pytest.raises(ValueError, match="seeds"):
        decode_payloads(blob, spec, out, [0, spec.numel])
    with pytest.raises(ValueError, match="seeds"):
        sum_payloads(blob, spec, torch.zeros(spec.numel), torch.empty(spec.numel))
    with pytest.raises(ValueError, match=r"seeds has shape \(1, 2\)"):
        decode_payloads(blob, spec, out, [0, spec.numel], torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="seeds must be an int64 tensor"):
        sum_payloads(blob, spec, torch.zeros(spec.numel), torch.empty(spec.numel), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="rotation='givens'"):
        PayloadSpec(((20, True),), 4, 8, rotation="givens")


def test_kernels_check_the_seed_table(cpu_kernels):
    """The C++ entry points themselves refuse a rotated decode without a [slots, segments] int64 table."""
    spec = PayloadSpec(((20, True),), 4, 8, torch.float32, "stochastic", torch.float32, "hadamard")
    blob = torch.zeros(2 * spec.nbytes, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"seeds: a rotated spec needs int64 seeds \[2, 1\]"):
        cpu_kernels.decode_payloads(blob, spec, torch.empty(2 * spec.numel), [0, spec.numel], None)
    with pytest.raises(RuntimeError, match=r"seeds: a rotated spec needs int64 seeds \[2, 1\]"):
        cpu_kernels.sum_payloads(blob, spec, torch.zeros(20), torch.empty(20), torch.zeros(1, 1, dtype=torch.int64))
    plain = PayloadSpec(((20, True),), 4, 8)  # unrotated: no table needed
    cpu_kernels.decode_payloads(blob[: 2 * plain.nbytes], plain, torch.empty(40), [0, 20], None)
