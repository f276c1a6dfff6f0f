"""CUDA kernels of the Hadamard-rotated payload codecs against the pure-torch reference, bit for bit.

Payload bytes, decoded values and sums (NaN bits included) over bit widths, power-of-two, odd,
multi-block and long buckets, element, output, base and metadata dtypes, both roundings, raw and
ragged segments, NaN/Inf buckets and several slots. The reference runs on the same device, so both
sides see the GPU's NaN arithmetic. Skipped where no CUDA device is present (the sources are
compile-checked without one by ``test_cuda_compile.py``); the C++ twin of these tests and the
reference's own oracles (an explicit Hadamard matrix, orthogonality) are in ``test_quant_rotation.py``,
whose device-generic checks these tests run with ``device="cuda"``; ``cuda_kernels`` is in ``conftest.py``.
"""

from __future__ import annotations

import pytest
import torch

from qaccel.quant import PayloadSpec
from tests._codec_checks import (
    BITS,
    BUCKETS,
    bucket_id,
    check_bits_and_bucket,
    check_dtypes,
    check_huge_magnitudes,
    check_matches_reference,
    check_zero_buckets,
    dtype_grid,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("bucket", BUCKETS, ids=bucket_id)
@pytest.mark.parametrize("bits", BITS)
def test_cuda_matches_reference(cuda_kernels, bits, bucket):
    """One block per cell (128, 1024), odd buckets (100 = 64+32+4, two per cell), several blocks (3000)."""
    check_bits_and_bucket(cuda_kernels, bits, bucket, device="cuda")


@dtype_grid
def test_cuda_matches_reference_dtypes(cuda_kernels, elem_dtype, meta, rounding, bucket):
    check_dtypes(cuda_kernels, elem_dtype, meta, rounding, bucket, device="cuda")


@pytest.mark.parametrize("bucket", [1, 2, 5, 8, 12, 31, 1000, 5000], ids=bucket_id)
def test_cuda_matches_reference_small_and_long_buckets(cuda_kernels, bucket):
    """Eight buckets per cell (1, 2, 5, 31), groups of 8 codes across blocks and buckets (5, 12, 31),
    every block length up to 512 (1000), and a bucket longer than a block (5000: rotated twice)."""
    segments = ((1003, True), (17, True), (6001, True))
    spec = PayloadSpec(segments, 5, bucket, torch.float32, "stochastic", torch.float32, rotation="hadamard")
    gen = torch.Generator().manual_seed(bucket)
    check_matches_reference(cuda_kernels, spec, 2, gen, special=False, device="cuda")


def test_cuda_matches_reference_huge_magnitudes(cuda_kernels):
    check_huge_magnitudes(cuda_kernels, device="cuda")


def test_cuda_zero_buckets(cuda_kernels):
    check_zero_buckets(cuda_kernels, device="cuda")


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
