"""``qaccel bench quant --study error``: the round-trip error, the chunk sampling, the command line.

References are independent of the code under test: a bucketed min/max quantizer and a Sylvester
Hadamard matrix written here in plain torch, and sums of squares taken by hand.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from qaccel.bench._quant_error import relative_mse, roundtrip, sample_chunks, segment_seeds, synthetic_kinds
from qaccel.cli import main
from qaccel.quant._rng import rotation_signs


def _nearest_minmax(x: torch.Tensor, bits: int, bucket: int) -> torch.Tensor:
    """Round-to-nearest on each bucket's [min, max] grid of 2**bits levels (fp32 metadata is exact here)."""
    levels = (1 << bits) - 1
    rows = x.double().view(-1, bucket)
    lo = rows.min(dim=1, keepdim=True).values
    step = (rows.max(dim=1, keepdim=True).values - lo) / levels
    return (lo + step * torch.floor((rows - lo) / step + 0.5)).reshape(-1)


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


@pytest.fixture(autouse=True)
def reference_codec(monkeypatch: pytest.MonkeyPatch) -> None:
    # The study measures the codec, not a backend: backends are bit-identical (tests/unit/test_quant_payloads.py),
    # and the reference needs no build.
    monkeypatch.setenv("QACCEL_KERNELS", "reference")


@pytest.fixture
def tiny() -> torch.Tensor:
    # Two buckets of 8: a spread of small values and one large outlier each (exact in fp32).
    return torch.tensor([0.5, -1.25, 2.0, 0.0, -0.75, 1.5, 40.0, -2.5, 3.0, -0.5, 0.25, -60.0, 1.0, 2.25, -1.75, 0.125])


def test_relative_mse_is_the_ratio_of_sums_of_squares() -> None:
    x = torch.tensor([1.0, -2.0, 2.0])
    x_hat = torch.tensor([1.5, -2.0, 1.0])
    assert relative_mse(x, x_hat) == pytest.approx((0.25 + 0.0 + 1.0) / 9.0, rel=1e-15)
    assert math.isnan(relative_mse(torch.zeros(3), x_hat))


def test_unrotated_nearest_roundtrip_matches_a_plain_minmax_quantizer(tiny: torch.Tensor) -> None:
    for bits in (2, 3, 4):
        decoded = roundtrip(tiny, (16,), bits=bits, bucket_size=8, meta_dtype=torch.float32, rounding="nearest",
                            rotation="none", seed=0)  # fmt: skip
        expected = _nearest_minmax(tiny, bits, 8)
        assert torch.allclose(decoded.double(), expected, rtol=0, atol=1e-5)
        plain = float(((expected - tiny.double()) ** 2).sum() / (tiny.double() ** 2).sum())
        assert relative_mse(tiny, decoded) == pytest.approx(plain, rel=1e-5)


def test_rotated_nearest_roundtrip_matches_a_hadamard_matrix_quantizer(tiny: torch.Tensor) -> None:
    bits, seed = 3, 5
    decoded = roundtrip(tiny, (16,), bits=bits, bucket_size=8, meta_dtype=torch.float32, rounding="nearest",
                        rotation="hadamard", seed=seed)  # fmt: skip
    signs = rotation_signs(int(segment_seeds(seed, 1)[0, 0]), 16)  # the sign of element i, from the segment's seed
    h = _sylvester(8)
    rotated = (h @ (tiny.double() * signs).view(2, 8).T).T.reshape(-1)  # each bucket times H
    expected = (h @ _nearest_minmax(rotated.float(), bits, 8).view(2, 8).T).T.reshape(-1) * signs
    assert torch.allclose(decoded.double(), expected, rtol=0, atol=1e-4)
    assert relative_mse(tiny, decoded) == pytest.approx(float(((expected - tiny) ** 2).sum() / (tiny**2).sum()), rel=1e-4)
    # The outliers no longer set the whole grid: the rotated round trip is the more accurate one here.
    unrotated = roundtrip(tiny, (16,), bits=bits, bucket_size=8, meta_dtype=torch.float32, rounding="nearest",
                          rotation="none", seed=seed)  # fmt: skip
    assert relative_mse(tiny, decoded) < relative_mse(tiny, unrotated)


def test_segments_restart_buckets() -> None:
    # One segment of 3 then one of 5 with bucket 4: buckets are [0:3], [3:7], [7:8].
    x = torch.tensor([0.0, 1.0, 3.0, 10.0, 11.0, 12.0, 13.0, -7.0])
    decoded = roundtrip(x, (3, 5), bits=2, bucket_size=4, meta_dtype=torch.float32, rounding="nearest", rotation="none",
                        seed=0)  # fmt: skip
    expected = torch.cat([_nearest_minmax(x[:3], 2, 3), _nearest_minmax(x[3:7], 2, 4), x[7:].double()])
    assert torch.allclose(decoded.double(), expected, rtol=0, atol=1e-6)


def test_sample_chunks_takes_every_kth_chunk_of_each_tensor() -> None:
    a = torch.arange(5 * 1024, dtype=torch.float32).view(5, 1024)
    b = -torch.arange(2 * 1024 + 7, dtype=torch.float32)
    values, segments = sample_chunks([a, b], stride=2)
    assert segments == (3 * 1024, 1024)
    flat_a = a.reshape(-1)
    expected = torch.cat([flat_a[0:1024], flat_a[2048:3072], flat_a[4096:5120], b[:1024]])
    assert torch.equal(values, expected)
    whole, whole_segments = sample_chunks([a, b], stride=1)
    assert whole_segments == (5 * 1024, 2 * 1024 + 7) and torch.equal(whole, torch.cat([flat_a, b]))


def test_synthetic_kinds_are_fixed_and_heavy_tailed() -> None:
    first, again = synthetic_kinds(20_000), synthetic_kinds(20_000)
    assert [k.name for k in first] == ["synthetic/student_t_df2", "synthetic/student_t_df3", "synthetic/gaussian_outliers"]
    assert all(torch.equal(a.values, b.values) for a, b in zip(first, again, strict=True))
    outliers = first[2].values
    assert 16 <= int((outliers.abs() > 5).sum()) <= 20  # 0.1% of the values, x100 (a few land near 0)
    for kind in first:
        assert kind.describe()["kurtosis"] > 6  # a Gaussian has 3


def test_cli_writes_json_png_markdown(tmp_path, capsys) -> None:
    path = tmp_path / "lowbit.json"
    argv = ["bench", "quant", "--study", "error", "--models", "none", "--bits", "2,8", "--synthetic_numel", "2048",
            "--seeds", "2", "--timing_numel", "2048", "--repeats", "1", "--json", str(path),
            "--markdown", str(tmp_path / "lowbit.md")]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(path.read_text())
    assert report["study"] == "error" and report["bits"] == [2, 8] and report["captured"] == []
    assert report["backend"] in ("reference", "cpu")
    assert set(report["kinds"]) == {"synthetic/student_t_df2", "synthetic/student_t_df3", "synthetic/gaussian_outliers"}
    assert len(report["errors"]) == 3 * 2 * 2  # kinds x bits x roundings
    row = report["errors"][0]
    assert {"kind", "bits", "bucket_size", "meta_dtype", "rounding", "rel_mse", "rel_mse_per_seed", "ratio_none_over_hadamard"} <= set(row)
    assert len(row["rel_mse_per_seed"]["hadamard"]) == 2
    assert row["rel_mse"]["none"] / row["rel_mse"]["hadamard"] == pytest.approx(row["ratio_none_over_hadamard"])
    buckets = {(r["bits"], r["bucket_size"], r["meta_dtype"]) for r in report["errors"]}
    assert buckets == {(2, 128, "bfloat16"), (8, 1024, "float32")}  # QSDP's per-bit defaults
    timing = report["timing"]
    assert [r["bits"] for r in timing["rows"]] == [4, 8] and timing["goal"]["max_encode_ratio"] == 1.5
    assert timing["goal"]["met"] is None  # the reference backend says nothing about the kernel
    assert set(timing["rows"][0]["encode_cpu_s"]) == {"none", "hadamard"}
    assert (tmp_path / "lowbit.png").stat().st_size > 0
    assert "| synthetic/student_t_df2 | 2 | 128 bfloat16 |" in (tmp_path / "lowbit.md").read_text()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--study", "error", "--bits", "1,4"], "--bits='1,4': every value must be in [2, 8]"),
        (["--study", "error", "--bits", "4,x"], "--bits='4,x': expected comma-separated integers"),
        (["--study", "error", "--models", "gpt5"], "--models: unknown recipe 'gpt5'"),
        (["--study", "error", "--seeds", "0"], "--seeds=0: must be >= 1"),
        (["--study", "error", "--numel", "8"], "--numel: not a flag of --study error"),
        (["--models", "none"], "--models: not a flag of --study throughput"),
    ],
)
def test_bad_arguments_are_one_line_usage_errors(flags: list[str], message: str, capsys) -> None:
    assert main(["bench", "quant", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
