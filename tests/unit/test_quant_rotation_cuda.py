"""CUDA kernels of the Hadamard-rotated payload codecs against the pure-torch reference, bit for bit.

Payload bytes, decoded values and sums (NaN bits included) over bit widths, power-of-two, odd,
multi-block and long buckets, element, output, base and metadata dtypes, both roundings, raw and
ragged segments, NaN/Inf buckets and several slots. The reference runs on the same device, so both
sides see the GPU's NaN arithmetic. Skipped where no CUDA device is present (the sources are
compile-checked without one by ``test_cuda_compile.py``); the C++ twin of these tests and the
reference's own oracles (an explicit Hadamard matrix, orthogonality) are in ``test_quant_rotation.py``.
"""

from __future__ import annotations

import pytest
import torch

from qaccel.quant import PayloadSpec, _native, reference
from tests.unit.test_quant_rotation import DTYPES, SEGMENTS, _bits_equal, _chunks, _seeds

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(scope="module")
def cuda_kernels():
    """The CUDA kernels (skipped where no toolkit can build them; a failed build fails the test)."""
    problem = _native.describe("cuda")["toolchain_problem"]
    if problem is not None:
        pytest.skip(f"CUDA kernels cannot be built here: {problem}")
    kernels, reason = _native.try_load("cuda")
    assert kernels is not None, f"the CUDA kernels failed to build: {reason}"
    return kernels


def _check_cuda_matches_reference(kernels, spec: PayloadSpec, slots: int, gen: torch.Generator, special: bool = True):
    """Encode (permuted, uneven offsets), decode into every output dtype, sum with several bases."""
    src = torch.cat([torch.randn(3).to(spec.elem_dtype), _chunks(spec, slots, gen, special)]).cuda()
    offsets = [3 + spec.numel * s for s in reversed(range(slots))]
    seeds = _seeds(slots, len(spec.segments), gen)
    expected = torch.full((slots * spec.nbytes,), 0xAB, dtype=torch.uint8, device="cuda")
    got = torch.full_like(expected, 0xCD)  # different garbage: padding must be written
    reference.encode_payloads(src, spec, offsets, seeds, expected)
    kernels.encode_payloads(src, spec, offsets, seeds, got)
    assert torch.equal(expected, got), f"payload bytes differ at {(expected != got).nonzero().flatten()[:8].tolist()}"

    device_seeds = seeds.cuda()  # decode takes the seed table on either device
    for index, out_dtype in enumerate(DTYPES):
        ref = torch.full((5 + slots * spec.numel,), 7.0, dtype=out_dtype, device="cuda")
        out = ref.clone()
        out_offsets = [5 + spec.numel * ((s + 1) % slots) for s in range(slots)]
        reference.decode_payloads(expected, spec, ref, out_offsets, seeds)
        kernels.decode_payloads(expected, spec, out, out_offsets, device_seeds if index % 2 else seeds)
        assert _bits_equal(ref, out), f"decoded into {out_dtype} differs"

    for base_dtype, out_dtype in ((torch.float32, torch.float32), (spec.elem_dtype, spec.elem_dtype),
                                  (torch.float32, torch.bfloat16), (torch.float16, torch.float32)):  # fmt: skip
        base = (torch.randn(spec.numel, generator=gen) * 0.05).to(base_dtype).cuda()
        ref = torch.empty(spec.numel, dtype=out_dtype, device="cuda")
        out = torch.full_like(ref, 3.0)
        reference.sum_payloads(expected, spec, base, ref, seeds)
        kernels.sum_payloads(expected, spec, base, out, device_seeds)
        assert _bits_equal(ref, out), f"sum base={base_dtype} out={out_dtype} differs"
        if base_dtype == out_dtype:  # in place, as the reduce-scatter sums into its own chunk
            aliased = base.clone()
            kernels.sum_payloads(expected, spec, aliased, aliased, seeds)
            assert _bits_equal(ref, aliased), "sum into base itself differs"
    return expected


@pytest.mark.parametrize("bucket", [128, 1024, 100, 3000], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_cuda_matches_reference(cuda_kernels, bits, bucket):
    """One block per cell (128, 1024), odd buckets (100 = 64+32+4, two per cell), several blocks (3000);
    element and metadata dtypes and roundings vary with the case (all combinations: the test below)."""
    case = bits * 7 + bucket
    elem_dtype = DTYPES[case % 3]
    meta = (torch.float32, torch.bfloat16)[case % 2]
    rounding = ("stochastic", "nearest")[(case // 2) % 2]
    spec = PayloadSpec(SEGMENTS, bits, bucket, meta, rounding, elem_dtype, rotation="hadamard")
    _check_cuda_matches_reference(cuda_kernels, spec, 3, torch.Generator().manual_seed(case))


@pytest.mark.parametrize("elem_dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("meta", [torch.float32, torch.bfloat16], ids=["meta32", "meta16"])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("bucket", [64, 24], ids=lambda b: f"B{b}")
def test_cuda_matches_reference_dtypes(cuda_kernels, elem_dtype, meta, rounding, bucket):
    segments = ((700, True), (3, False), (130, True), (7, True))
    spec = PayloadSpec(segments, 4, bucket, meta, rounding, elem_dtype, rotation="hadamard")
    _check_cuda_matches_reference(cuda_kernels, spec, 2, torch.Generator().manual_seed(bucket + len(str(meta))))


@pytest.mark.parametrize("bucket", [1, 2, 5, 8, 12, 31, 1000, 5000], ids=lambda b: f"B{b}")
def test_cuda_matches_reference_small_and_long_buckets(cuda_kernels, bucket):
    """Eight buckets per cell (1, 2, 5, 31), groups of 8 codes across blocks and buckets (5, 12, 31),
    every block length up to 512 (1000), and a bucket longer than a block (5000: rotated twice)."""
    segments = ((1003, True), (17, True), (6001, True))
    spec = PayloadSpec(segments, 5, bucket, torch.float32, "stochastic", torch.float32, rotation="hadamard")
    _check_cuda_matches_reference(cuda_kernels, spec, 2, torch.Generator().manual_seed(bucket), special=False)


def test_cuda_matches_reference_huge_magnitudes(cuda_kernels):
    """Rotated values that overflow fp32 (non-finite buckets) and bf16 grids that round past fp32's max."""
    segments = ((4096, True), (300, True))
    for meta in (torch.float32, torch.bfloat16):
        spec = PayloadSpec(segments, 3, 256, meta, "stochastic", torch.float32, rotation="hadamard")
        gen = torch.Generator().manual_seed(5)
        src = torch.randn(2 * spec.numel, generator=gen) * 1e37
        src[:256] *= 30.0  # sums of 256 values near 3e38: |r| > fp32 max, the bucket turns non-finite
        src[1000] = 3.4e38
        src[2000:2256] = -3.3e38  # a bucket near -max: bf16 lo rounds down past it
        src = src.cuda()
        seeds = _seeds(2, len(segments), gen)
        expected = torch.empty(2 * spec.nbytes, dtype=torch.uint8, device="cuda")
        got = torch.empty_like(expected)
        reference.encode_payloads(src, spec, [0, spec.numel], seeds, expected)
        cuda_kernels.encode_payloads(src, spec, [0, spec.numel], seeds, got)
        assert torch.equal(expected, got)
        ref, out = torch.empty(2 * spec.numel, device="cuda"), torch.empty(2 * spec.numel, device="cuda")
        reference.decode_payloads(expected, spec, ref, [0, spec.numel], seeds)
        cuda_kernels.decode_payloads(expected, spec, out, [0, spec.numel], seeds)
        assert _bits_equal(ref, out)
        assert ref.isnan().any() and ref.isfinite().any()


def test_cuda_zero_buckets(cuda_kernels):
    """All-zero buckets rotate to mixed +-0: same codes and scales, lo equal as a value, same decode.

    The sign of a zero min is unspecified (reference module docstring, step 3): torch's amin keeps
    whichever zero its reduction meets first, the CUDA kernels the smaller key (-0.0).
    """
    segments = ((1024, True), (640, True))
    spec = PayloadSpec(segments, 4, 128, torch.float32, "stochastic", torch.float32, rotation="hadamard")
    src = torch.zeros(spec.numel)
    src[1024 + 128 : 1024 + 256] = torch.randn(128, generator=torch.Generator().manual_seed(0))
    src = src.cuda()
    seeds = torch.tensor([[11, -7]], dtype=torch.int64)
    expected = torch.empty(spec.nbytes, dtype=torch.uint8, device="cuda")
    got = torch.empty_like(expected)
    reference.encode_payloads(src, spec, [0], seeds, expected)
    cuda_kernels.encode_payloads(src, spec, [0], seeds, got)
    meta = slice(spec.meta_offset, spec.meta_offset + 4 * spec.num_buckets)
    assert torch.equal(expected[: spec.meta_offset], got[: spec.meta_offset]), "codes differ"
    assert torch.equal(expected[meta.stop :], got[meta.stop :]), "scales differ"
    assert torch.equal(expected[meta].view(torch.float32), got[meta].view(torch.float32)), "lo differs in value"
    for blob in (expected, got):
        ref, out = torch.empty(spec.numel, device="cuda"), torch.empty(spec.numel, device="cuda")
        reference.decode_payloads(blob, spec, ref, [0], seeds)
        cuda_kernels.decode_payloads(blob, spec, out, [0], seeds)
        assert _bits_equal(ref, out)
        assert torch.equal(out[:1024], torch.zeros(1024, device="cuda"))


def test_cuda_binding_checks_the_seed_table(cuda_kernels):
    """A rotated decode or sum needs the [slots, segments] seeds: the binding refuses none or a wrong shape."""
    spec = PayloadSpec(((300, True), (9, False)), 4, 64, rotation="hadamard")
    blob = torch.zeros(2 * spec.nbytes, dtype=torch.uint8, device="cuda")
    out = torch.empty(2 * spec.numel, device="cuda")
    for seeds in (None, torch.zeros((1, 2), dtype=torch.int64), torch.zeros((2, 3), dtype=torch.int64)):
        with pytest.raises(RuntimeError, match="seeds: a rotated spec needs the int64 \\[2, 2\\]"):
            cuda_kernels.decode_payloads(blob, spec, out, [0, spec.numel], seeds)
        with pytest.raises(RuntimeError, match="seeds: a rotated spec needs the int64 \\[2, 2\\]"):
            cuda_kernels.sum_payloads(blob, spec, out[: spec.numel], out[spec.numel :], seeds)
    unrotated = PayloadSpec(spec.segments, 4, 64)  # seeds are ignored: no signs to undo
    cuda_kernels.decode_payloads(torch.zeros(2 * unrotated.nbytes, dtype=torch.uint8, device="cuda"), unrotated, out,
                                 [0, unrotated.numel])  # fmt: skip
