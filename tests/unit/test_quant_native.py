"""The C++ (CPU) codec kernels against the pure-torch reference, bit for bit, and backend choice.

The oracle is :mod:`qaccel.quant.reference` (the specification), an independent implementation in
vectorized torch. Codes, ``lo``, ``scale`` and decoded values must be identical (``torch.equal``,
NaN in the same places and with the same bits) for every shape, bit width, bucket size, dtype,
rounding, metadata dtype, seed and thread count. The first test run builds the kernels (about
half a minute); the build is cached on disk.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qaccel import quant
from qaccel.quant import _backend, _native, _native_build, reference

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BUCKETS = [1, 3, 64, 128, 1000, 1024]
BITS = list(range(2, 9))
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _assert_identical(expected: torch.Tensor, got: torch.Tensor, what: str) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape, what
    if expected.is_floating_point():
        # Bit patterns, so NaN positions (and payloads) and signed zeros must match too.
        assert torch.equal(expected.view(INT_VIEW[expected.dtype]), got.view(INT_VIEW[got.dtype])), what
    else:
        assert torch.equal(expected, got), what


def _assert_same_quantization(expected, got, what: str) -> None:
    codes, lo, scale = expected
    _assert_identical(codes, got[0], f"codes {what}")
    # lo/scale: equal as numbers with NaN in the same places. The sign of a zero min/max is not
    # specified: torch's amin/amax pick either zero of a bucket holding +0.0 and -0.0 depending on
    # their reduction order, while the native backends always pick -0.0 (min) and +0.0 (max).
    for name, a, b in (("lo", lo, got[1]), ("scale", scale, got[2])):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{name} {what}"
        assert torch.equal(a.isnan(), b.isnan()), f"{name} NaN positions {what}"
        assert torch.equal(a[~a.isnan()], b[~b.isnan()]), f"{name} {what}"


def _check(kernels, x, bits, bucket, nearest, seed, meta, out_dtype=torch.float32, accumulate=False):
    what = f"(numel={x.numel()}, bits={bits}, B={bucket}, {x.dtype}, nearest={nearest}, seed={seed}, meta={meta})"
    expected = reference.quantize_buckets(x, bits, bucket, nearest, seed, meta)
    got = kernels.quantize_buckets(x, bits, bucket, nearest, seed, meta)
    _assert_same_quantization(expected, got, what)
    base = torch.linspace(-3, 3, x.numel()).to(out_dtype)
    out_ref, out_got = base.clone(), base.clone()
    reference.dequantize_into(*expected, bits, bucket, out_ref, accumulate)
    kernels.dequantize_into(*expected, bits, bucket, out_got, accumulate)
    _assert_identical(out_ref, out_got, f"decoded into {out_dtype} accumulate={accumulate} {what}")


# -- fixed grid of edge sizes ----------------------------------------------------------------------


def _edge_numel(kind: str, bucket: int) -> int:
    return {"0": 0, "1": 1, "7": 7, "9": 9, "B-1": max(bucket - 1, 0), "B": bucket, "B+1": bucket + 1,
            "2B+13": 2 * bucket + 13}[kind]  # fmt: skip


@pytest.mark.parametrize("mode", ["stochastic-fp32meta", "nearest-bf16meta"])
@pytest.mark.parametrize("kind", ["0", "1", "7", "9", "B-1", "B", "B+1", "2B+13"])
@pytest.mark.parametrize("bucket", BUCKETS, ids=lambda b: f"B{b}")
@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"{b}bit")
def test_edge_sizes_bit_identical(cpu_kernels, bits, bucket, kind, mode):
    numel = _edge_numel(kind, bucket)
    generator = torch.Generator().manual_seed(numel * 31 + bits)
    x = torch.randn(numel, generator=generator) * 4 - 1
    nearest = mode.startswith("nearest")
    meta = torch.bfloat16 if mode.endswith("bf16meta") else torch.float32
    _check(cpu_kernels, x, bits, bucket, nearest, seed=2**33 + bits, meta=meta)


# -- randomized cross product (hypothesis) ---------------------------------------------------------

# Magnitudes stay below the largest bf16 (3.3895e38); beyond it see test_bf16_grid_overflow_decodes_to_nan.
_SPECIALS = [math.nan, math.inf, -math.inf, 3e38, -3e38, 0.0, -0.0, 1e-40, -1e-45, 65504.0]


@st.composite
def _cases(draw):
    numel = draw(st.one_of(st.integers(0, 40), st.integers(0, 3000), st.integers(0, 100_000)))
    bucket = draw(st.one_of(st.sampled_from(BUCKETS), st.integers(1, 5000)))
    dtype = draw(st.sampled_from(list(DTYPES.values())))
    scale = draw(st.sampled_from([1e-30, 1e-3, 1.0, 1e4, 1e30]))
    seed = draw(st.integers(0, 2**64 - 1))
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed % 2**63)) * scale
    if numel and draw(st.booleans()):  # constant runs (whole constant buckets)
        start = draw(st.integers(0, numel - 1))
        x[start : start + draw(st.integers(1, 3000))] = draw(st.sampled_from([0.0, -2.5, 7.0]))
    for _ in range(draw(st.integers(0, 3)) if numel else 0):
        x[draw(st.integers(0, numel - 1))] = draw(st.sampled_from(_SPECIALS))
    return {
        "x": x.to(dtype),
        "bits": draw(st.sampled_from(BITS)),
        "bucket": bucket,
        "nearest": draw(st.booleans()),
        "seed": seed,
        "meta": draw(st.sampled_from([torch.float32, torch.bfloat16])),
        "out_dtype": draw(st.sampled_from(list(DTYPES.values()))),
        "accumulate": draw(st.booleans()),
        "threads": draw(st.sampled_from([1, 2])),
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=_cases())
def test_random_cases_bit_identical(cpu_kernels, case):
    threads = torch.get_num_threads()
    torch.set_num_threads(case.pop("threads"))
    try:
        _check(cpu_kernels, **case)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("meta", [torch.float32, torch.bfloat16], ids=["fp32meta", "bf16meta"])
@pytest.mark.parametrize("bits", [2, 5, 8], ids=lambda b: f"{b}bit")
def test_huge_magnitudes_and_non_finite_buckets(cpu_kernels, bits, meta):
    biggest = 3.4028234e38 if meta == torch.float32 else 3.38e38  # largest bf16: 3.3895e38
    x = torch.cat([
        torch.tensor([3e38, -3e38, 1.0, 2.0] * 16 + [-3.38e38, 3.38e38] * 32),  # two finite huge buckets
        torch.tensor([math.nan] + [1.0] * 63 + [math.inf, -math.inf] * 32),  # two poisoned buckets
        torch.full((64,), biggest), torch.full((64,), -biggest), torch.zeros(64),  # constant buckets
        torch.tensor([0.0, -0.0] * 32),
    ])  # fmt: skip
    _check(cpu_kernels, x, bits, 64, nearest=False, seed=5, meta=meta)
    _, _, scale = cpu_kernels.quantize_buckets(x, bits, 64, False, 5, meta)
    assert scale[2:4].isnan().all() and not scale[:2].isnan().any() and not scale[4:].isnan().any()


@pytest.mark.parametrize("bits", [2, 7, 8])
def test_bf16_grid_overflow_decodes_to_nan(cpu_kernels, bits):
    # |min| above the largest bf16 rounds lo down to -inf, so the bucket decodes to NaN; its
    # codes are defined as 0 in every backend.
    x = torch.tensor([-3.4e38, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 3.4e38])
    _check(cpu_kernels, x, bits, 16, nearest=False, seed=1, meta=torch.bfloat16)
    out = torch.empty(10)
    cpu_kernels.dequantize_into(*cpu_kernels.quantize_buckets(x, bits, 16, False, 1, torch.bfloat16), bits, 16, out, False)
    assert out.isnan().all()


@pytest.mark.parametrize("threads", [1, 2])
def test_thread_count_does_not_change_results(cpu_kernels, threads):
    x = torch.randn(300_001, generator=torch.Generator().manual_seed(3))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for bits, bucket in ((4, 1024), (3, 1000), (8, 7)):
            _check(cpu_kernels, x, bits, bucket, nearest=False, seed=11, meta=torch.float32)
        # A bucket longer than the fused limit takes the two-pass path.
        _check(cpu_kernels, x, 5, 100_000, nearest=False, seed=11, meta=torch.bfloat16)
    finally:
        torch.set_num_threads(previous)


# -- sign codec --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize(("numel", "chunks"), [(0, 1), (1, 1), (7, 1), (8, 2), (9, 3), (1000, 4), (70_001, 1), (65_536, 8)])
def test_sign_codec_bit_identical(cpu_kernels, numel, chunks, dtype):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype)
    if numel > 4:
        x[:4] = torch.tensor([0.0, -0.0, math.nan, -math.inf]).to(dtype)
    signs = cpu_kernels.sign_pack(x, chunks)
    _assert_identical(reference.sign_pack(x, chunks), signs, "signs")
    scales = cpu_kernels.chunk_rms(x, chunks)
    out_ref, out_got = torch.empty(numel), torch.empty(numel)
    reference.sign_unpack(signs, scales, numel, out_ref)
    cpu_kernels.sign_unpack(signs, scales, numel, out_got)
    _assert_identical(out_ref, out_got, "sign_unpack")


def test_chunk_rms_is_the_reference_norm(cpu_kernels):
    assert cpu_kernels.chunk_rms is reference.chunk_rms


def test_native_functions_have_the_reference_signatures(cpu_kernels):
    import inspect

    for name in ("quantize_buckets", "dequantize_into", "sign_pack", "sign_unpack", "chunk_rms", "onebit_encode",
                 "onebit_server"):  # fmt: skip
        expected = list(inspect.signature(getattr(reference, name)).parameters)
        assert list(inspect.signature(getattr(cpu_kernels, name)).parameters) == expected, name


# -- backend choice (QACCEL_KERNELS) and the build cache ---------------------------------------------


def test_invalid_backend_lists_the_choices(monkeypatch):
    monkeypatch.setenv("QACCEL_KERNELS", "gpu")
    with pytest.raises(ValueError, match="QACCEL_KERNELS='gpu'.*auto, reference, cpu, cuda"):
        quant.quantize(torch.ones(8), bits=4)


def test_reference_forced(monkeypatch):
    monkeypatch.setenv("QACCEL_KERNELS", "reference")
    assert _backend.kernels_for(torch.device("cpu")) is reference
    assert list(_backend.available_kernels("cpu")) == ["reference"]


def test_auto_and_explicit_cpu_use_the_cpp_kernels(cpu_kernels, monkeypatch):
    for value in ("auto", "cpu"):
        monkeypatch.setenv("QACCEL_KERNELS", value)
        assert _backend.kernels_for(torch.device("cpu")) is cpu_kernels
    assert set(_backend.available_kernels("cpu")) == {"reference", "cpu"}
    x = torch.randn(5000)
    q = quant.quantize(x, bits=3, bucket_size=100, seed=4)
    assert torch.equal(q.codes, reference.quantize_buckets(x, 3, 100, False, 4, torch.float32)[0])


def test_backend_of_the_wrong_device_is_a_value_error(monkeypatch):
    monkeypatch.setenv("QACCEL_KERNELS", "cuda")
    with pytest.raises(ValueError, match="cuda kernels cannot run on a cpu tensor"):
        quant.quantize(torch.ones(8), bits=4)
    monkeypatch.setenv("QACCEL_KERNELS", "cpu")
    with pytest.raises(ValueError, match="cpu kernels cannot run on a cuda tensor"):
        _backend.kernels_for(torch.device("cuda"))


def test_status_reports_every_backend(cpu_kernels):
    report = _backend.status(build=False)
    assert report["reference"] == {"available": True, "built": True}
    assert report["cpu"]["available"] and report["cpu"]["built"] and report["cpu"]["loaded"]
    assert report["cpu"]["name"] == _native.build_name("cpu")
    if torch.version.cuda is None:
        assert report["cuda"]["available"] is False and "no CUDA support" in report["cuda"]["reason"]


def test_build_name_hashes_sources_schemas_and_flags(tmp_path, monkeypatch):
    name = _native.build_name("cpu")
    for source in os.listdir(_native.CSRC):
        (tmp_path / source).write_bytes((_native.CSRC / source).read_bytes())
    monkeypatch.setattr(_native_build, "CSRC", tmp_path)
    assert _native.build_name("cpu") == name
    (tmp_path / "quant_common.h").write_text((tmp_path / "quant_common.h").read_text() + "\n// changed\n")
    changed_source = _native.build_name("cpu")
    assert changed_source != name
    monkeypatch.setattr(_native_build, "CXX_FLAGS", (*_native_build.CXX_FLAGS, "-DQACCEL_TEST_FLAG"))
    changed_flags = _native.build_name("cpu")
    assert changed_flags not in (name, changed_source)
    # the kernels are checked against the schemas at load time: a schema edit must not reuse a build
    schemas = {**_native_build.SCHEMAS, "sign_pack": "(Tensor x, int chunks, int extra) -> Tensor"}
    monkeypatch.setattr(_native_build, "SCHEMAS", schemas)
    assert _native.build_name("cpu") not in (name, changed_source, changed_flags)


_FALLBACK_SCRIPT = textwrap.dedent(
    """
    import os, warnings, torch
    from qaccel import quant
    from qaccel.quant import reference
    assert not os.listdir(os.environ["QACCEL_CACHE_DIR"]), "nothing may compile at import"
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q1 = quant.quantize(x, bits=4, seed=3)
        q2 = quant.quantize(x, bits=8, bucket_size=100, seed=4)
        y = quant.dequantize(q1)
    fallback = [w for w in caught if "codec kernels are unavailable" in str(w.message)]
    assert len(fallback) == 1, [str(w.message) for w in caught]
    assert "QACCEL_KERNELS=reference" in str(fallback[0].message), fallback[0].message
    assert "build failed" in str(fallback[0].message), fallback[0].message
    expected = reference.quantize_buckets(x, 4, 1024, False, 3, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(expected, (q1.codes, q1.lo, q1.scale)))
    assert torch.equal(q2.codes, reference.quantize_buckets(x, 8, 100, False, 4, torch.float32)[0])
    assert torch.equal(y, reference.dequantize_into(*expected, 4, 1024, torch.empty(10_000), False))
    os.environ["QACCEL_KERNELS"] = "cpu"
    try:
        quant.quantize(x, bits=4)
    except RuntimeError as error:
        assert "build failed" in str(error), error
    else:
        raise AssertionError("an explicit QACCEL_KERNELS=cpu with a broken compiler must raise")
    print("FALLBACK-OK")
    """
)


def test_auto_falls_back_with_one_warning_when_the_build_fails(tmp_path):
    # A compiler that exists but fails every compile: the real build path runs and fails.
    env = {**os.environ, "CXX": "/bin/false", "QACCEL_CACHE_DIR": str(tmp_path), "QACCEL_KERNELS": "auto"}
    result = subprocess.run(
        [sys.executable, "-c", _FALLBACK_SCRIPT], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FALLBACK-OK" in result.stdout


def test_missing_compiler_is_reported_without_building(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    problem = _native.describe("cpu")["toolchain_problem"]
    assert problem is not None and "no C++ compiler" in problem
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # describe() never builds or warns
        _native.describe("cpu")
