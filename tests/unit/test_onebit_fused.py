"""The fused 1-bit error-feedback ops (``qaccel.quant.onebit_encode`` / ``onebit_server``).

Oracle: the unfused sequence ``qaccel.comm._onebit`` ran before the ops existed, written out here
with the public ``sign_compress`` / ``sign_decompress`` and torch arithmetic. Every backend's fused
op must give exactly its sign bytes, its scales and its error buffer, bit for bit (NaN/Inf, signed
zeros and zero scales included).
"""

from __future__ import annotations

import math

import pytest
import torch

from qaccel.quant import SignCompressed, onebit_encode, onebit_server, reference, sign_compress, sign_decompress
from tests._codec_checks import bits_equal

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _unfused_worker(x: torch.Tensor, error: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    compensated = torch.zeros(error.numel(), dtype=torch.float32)
    compensated[: x.numel()] = x.reshape(-1)
    compensated.add_(error)
    packed = sign_compress(compensated)
    error.copy_(compensated - sign_decompress(packed))
    return packed.signs, packed.scales


def _unfused_server(
    signs: torch.Tensor, scales: torch.Tensor, error: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    world, numel = scales.numel(), error.numel()
    worker_chunks = SignCompressed(signs=signs.reshape(-1), scales=scales * (1 / world), numel=world * numel,
                                   chunks=world, shape=torch.Size((world, numel)))  # fmt: skip
    averaged = sign_decompress(worker_chunks).sum(0)
    averaged.add_(error)
    packed = sign_compress(averaged)
    error.copy_(averaged - sign_decompress(packed))
    return packed.signs, packed.scales


def _values(numel: int, seed: int, dtype: torch.dtype = torch.float32, special: bool = True) -> torch.Tensor:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 3
    if special and numel >= 8:
        x[:4] = torch.tensor([0.0, -0.0, 1e-30, -1e-30])
    return x.to(dtype)


def _same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> bool:
    return all(bits_equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.fixture(params=["reference", "cpu"])
def backend(request, monkeypatch):
    """Each backend through the public functions (QACCEL_KERNELS), the C++ one built first."""
    if request.param == "cpu":
        request.getfixturevalue("cpu_kernels")
    monkeypatch.setenv("QACCEL_KERNELS", request.param)
    return request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("numel", "padded"), [(1, 8), (7, 8), (100, 112), (1000, 1024), (70_001, 70_016), (131_072, 131_072)]
)
def test_encode_matches_the_unfused_worker_side(backend, numel, padded, dtype):
    x = _values(numel, numel, dtype)
    error = _values(padded, numel + 1) * 0.1
    error[-1] = -0.0  # a negative zero in the padding: 0 + (-0.0) is +0.0 in the unfused sequence
    want_error, got_error = error.clone(), error.clone()
    want = _unfused_worker(x, want_error)
    for step in range(2):  # the second step starts from the error the first one left
        got = onebit_encode(x, got_error)
        assert _same(got, want) and bits_equal(got_error, want_error), (backend, step)
        want = _unfused_worker(x, want_error)


def test_float64_values_are_read_as_fp32_as_the_unfused_side(backend):
    x = torch.randn(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) / 3
    want_error, got_error = torch.zeros(1024), torch.zeros(1024)
    want = _unfused_worker(x, want_error)
    assert _same(onebit_encode(x, got_error), want) and bits_equal(got_error, want_error)


@pytest.mark.parametrize("special", [math.nan, math.inf, -math.inf])
def test_encode_non_finite_values_as_the_unfused_side(backend, special):
    x = _values(1000, 3)
    x[17] = special
    want_error, got_error = torch.zeros(1024), torch.zeros(1024)
    want = _unfused_worker(x, want_error)
    got = onebit_encode(x, got_error)
    assert _same(got, want) and bits_equal(got_error, want_error)
    assert not math.isfinite(float(got[1][0]))  # the scale carries the overflow, as today


@pytest.mark.parametrize(
    ("world", "numel"), [(1, 8), (2, 24), (3, 1000), (4, 4104), (7, 1000), (16, 70_000), (64, 512)]
)
def test_server_matches_the_unfused_server_side(backend, world, numel):
    gen = torch.Generator().manual_seed(world * numel)
    signs = torch.randint(0, 256, (world, (numel + 7) // 8), dtype=torch.uint8, generator=gen)
    scales = torch.rand(world, generator=gen) * 10.0 ** torch.randint(-4, 4, (world,), generator=gen)
    if world > 2:
        scales[1] = 0.0  # a worker whose chunk was all zeros
    error = _values(numel, world) * 0.01
    want_error, got_error = error.clone(), error.clone()
    want = _unfused_server(signs, scales, want_error)
    got = onebit_server(signs, scales, got_error)
    assert _same(got, want) and bits_equal(got_error, want_error)


def test_server_with_zero_scales_keeps_the_signed_zeros_of_the_unfused_side(backend):
    signs = torch.tensor([[0b10100000], [0b01100000]], dtype=torch.uint8)
    error = torch.tensor([0.0, -0.0, 0.0, -0.0, 1.0, -1.0, 0.0, -0.0])
    want_error, got_error = error.clone(), error.clone()
    want = _unfused_server(signs, torch.zeros(2), want_error)
    got = onebit_server(signs, torch.zeros(2), got_error)
    assert _same(got, want) and bits_equal(got_error, want_error)


def test_several_chunks_match_the_reference(cpu_kernels):
    x, error = _values(4000, 5, torch.bfloat16), _values(4096, 6) * 0.1
    ref_error, cpu_error = error.clone(), error.clone()
    assert _same(cpu_kernels.onebit_encode(x, cpu_error, 8), reference.onebit_encode(x, ref_error, 8))
    assert bits_equal(cpu_error, ref_error)
    signs = reference.sign_pack(_values(3 * 4096, 7), 3)
    assert _same(cpu_kernels.onebit_server(signs, torch.tensor([1.0, 0.5, 3.0]), cpu_error, 4),
                 reference.onebit_server(signs, torch.tensor([1.0, 0.5, 3.0]), ref_error, 4))  # fmt: skip
    assert bits_equal(cpu_error, ref_error)


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_results_do_not_depend_on_the_thread_count(cpu_kernels, threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, error = _values(300_001, 8), torch.zeros(300_008)
        want_error = error.clone()
        assert _same(cpu_kernels.onebit_encode(x, error, 1), _unfused_worker(x, want_error))
        assert bits_equal(error, want_error)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: onebit_encode(torch.ones(9), torch.zeros(8)), "must fit error"),
        (lambda: onebit_encode(torch.ones(8), torch.zeros(8, dtype=torch.float64)), "1-D float32"),
        (lambda: onebit_encode(torch.ones(8), torch.zeros(8), chunks=3), "chunks=3"),
        (lambda: onebit_encode(torch.ones(8, dtype=torch.int32), torch.zeros(8)), "x must be a floating-point"),
        (lambda: onebit_server(torch.zeros(3, dtype=torch.uint8), torch.ones(2), torch.zeros(8)), "2 rows of 1 bytes"),
        (lambda: onebit_server(torch.zeros(2, dtype=torch.uint8), torch.ones(2, 1), torch.zeros(8)), "scales must be"),
    ],
)
def test_bad_arguments_are_refused_with_the_bad_value(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_the_cpp_kernel_refuses_bad_arguments_itself(cpu_kernels):
    with pytest.raises(RuntimeError, match="chunks=3: must divide error.numel\\(\\)=8"):
        torch.ops.qaccel.onebit_encode(torch.ones(8), torch.zeros(8), 3)
    with pytest.raises(RuntimeError, match="signs has 3 bytes: expected 2 rows of 1"):
        torch.ops.qaccel.onebit_server(torch.zeros(3, dtype=torch.uint8), torch.ones(2), torch.zeros(8), 1)
