"""Fused payload codecs (encode_payloads / decode_payloads / sum_payloads): bytes and values.

Two oracles:
- the C++ kernels against the pure-torch reference, bit for bit (payload bytes, decoded values
  with NaN bits), over element and output dtypes, bits 2..8, both metadata dtypes, both roundings,
  odd and empty segments, raw segments, NaN/Inf buckets, 0..4 slots and long buckets;
- the reference against the per-segment path it replaces, ``qaccel.comm.encode_chunk`` /
  ``decode_chunk`` (one ``quantize``/``dequantize`` per segment) and the fp32 accumulation the
  reduce-scatter did (``total = base.float()``; ``decode_chunk(..., accumulate=True)`` per slot).
"""

from __future__ import annotations

import pytest
import torch

from qaccel.comm import PayloadLayout, WireCodec, decode_chunk, encode_chunk, mix_seed
from qaccel.quant import PayloadSpec, _native, decode_payloads, encode_payloads, reference, sum_payloads
from tests._codec_checks import DTYPES, bits_equal

# Odd lengths, empty segments of both kinds, a one-element bucket tail, raw runs between weights.
SEGMENTS = ((1000, True), (37, False), (0, True), (1029, True), (0, False), (5, False), (9, True), (1, True))


def _as_int64(seed: int) -> int:
    return seed - (1 << 64) if seed >= (1 << 63) else seed


def _chunk_data(spec: PayloadSpec, slots: int, gen: torch.Generator, special: bool = True) -> torch.Tensor:
    """``slots`` chunks back to back; weight-like segments, raw ~1 runs, and NaN/Inf buckets."""
    chunks = []
    for slot in range(slots):
        parts = []
        for index, (numel, quantized) in enumerate(spec.segments):
            scale = 0.02 * (index + 1) if quantized else 0.01
            part = torch.randn(numel, generator=gen) * scale + (0.0 if quantized else 1.0)
            if special and numel > 100 and quantized:
                part[3 + slot] = float("nan")  # first bucket non-finite
                part[numel - 2] = float("inf") if slot % 2 else -float("inf")  # last bucket
                part[numel // 2] = 3.0e4  # a wide but finite bucket (fp16 holds it)
            if special and not quantized and numel > 10:
                part[slot] = -float("inf")  # raw segments carry non-finite values as they are
            parts.append(part)
        chunks.append(torch.cat(parts) if parts else torch.zeros(0))
    return torch.cat(chunks).to(spec.elem_dtype)


def _seed_table(slot_seeds: list[int], nseg: int) -> torch.Tensor:
    rows = [[_as_int64(mix_seed(seed, i)) for i in range(nseg)] for seed in slot_seeds]
    return torch.tensor(rows, dtype=torch.int64).reshape(len(slot_seeds), nseg)


def _encode_both(kernels, spec, src, offsets, seeds):
    out_ref = torch.full((len(offsets) * spec.nbytes,), 0xAB, dtype=torch.uint8)
    out_cpu = torch.full_like(out_ref, 0xCD)  # different garbage: padding must be written, not kept
    reference.encode_payloads(src, spec, offsets, seeds, out_ref)
    kernels.encode_payloads(src, spec, offsets, seeds, out_cpu)
    return out_ref, out_cpu


# -- native == reference, bit for bit ----------------------------------------------------------------


@pytest.mark.parametrize("elem_dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("meta", [torch.float32, torch.bfloat16], ids=["meta32", "meta16"])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_cpu_kernels_match_reference(cpu_kernels, elem_dtype, bits, meta, rounding):
    spec = PayloadSpec(SEGMENTS, bits, 64, meta, rounding, elem_dtype)
    slots = 1 + bits % 4
    gen = torch.Generator().manual_seed(bits * 7 + slots)
    # Chunks sit at uneven offsets of a larger tensor, in a permuted order.
    src = torch.cat([torch.randn(3).to(elem_dtype), _chunk_data(spec, slots, gen)])
    offsets = [3 + spec.numel * s for s in reversed(range(slots))]
    seeds = torch.randint(-(2**63), 2**63 - 1, (slots, len(SEGMENTS)), generator=gen, dtype=torch.int64)
    out_ref, out_cpu = _encode_both(cpu_kernels, spec, src, offsets, seeds)
    assert torch.equal(out_ref, out_cpu), f"payload bytes differ (slots={slots})"

    for out_dtype in DTYPES:
        size = 5 + spec.numel * slots
        ref = torch.full((size,), 7.0, dtype=out_dtype)
        got = ref.clone()
        out_offsets = [5 + spec.numel * ((s + 1) % slots) for s in range(slots)]
        reference.decode_payloads(out_ref, spec, ref, out_offsets)
        cpu_kernels.decode_payloads(out_ref, spec, got, out_offsets)
        assert bits_equal(ref, got), f"decoded into {out_dtype} differs"
        assert torch.equal(ref[:5], torch.full((5,), 7.0, dtype=out_dtype)), "decode wrote outside its chunks"

    for base_dtype, out_dtype in ((torch.float32, torch.float32), (elem_dtype, elem_dtype), (torch.float32, torch.bfloat16),
                                  (torch.float16, torch.float32)):  # fmt: skip
        base = (torch.randn(spec.numel, generator=gen) * 0.05).to(base_dtype)
        ref = torch.empty(spec.numel, dtype=out_dtype)
        got = torch.empty(spec.numel, dtype=out_dtype)
        reference.sum_payloads(out_ref, spec, base, ref)
        cpu_kernels.sum_payloads(out_ref, spec, base, got)
        assert bits_equal(ref, got), f"sum base={base_dtype} out={out_dtype} differs"
        if base_dtype == out_dtype:  # base aliasing out (the reduce-scatter's output holds its own chunk)
            aliased = base.clone()
            cpu_kernels.sum_payloads(out_ref, spec, aliased, aliased)
            assert bits_equal(ref, aliased), "sum into base itself differs"


@pytest.mark.parametrize("bucket", [1, 3, 12, 1000, 5000], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("bits", [3, 8])
def test_cpu_kernels_match_reference_other_buckets(cpu_kernels, bucket, bits):
    """Buckets not a multiple of 8 (groups straddle buckets) and longer than the C++ fused-tile limit."""
    segments = ((7000, True), (3, False), (40000, True), (13, True))
    spec = PayloadSpec(segments, bits, bucket, torch.bfloat16, "stochastic", torch.float32)
    gen = torch.Generator().manual_seed(bucket)
    src = _chunk_data(spec, 2, gen)
    seeds = torch.randint(-(2**63), 2**63 - 1, (2, len(segments)), generator=gen, dtype=torch.int64)
    out_ref, out_cpu = _encode_both(cpu_kernels, spec, src, [0, spec.numel], seeds)
    assert torch.equal(out_ref, out_cpu)
    ref, got = torch.empty(2 * spec.numel), torch.empty(2 * spec.numel)
    reference.decode_payloads(out_ref, spec, ref, [spec.numel, 0])
    cpu_kernels.decode_payloads(out_ref, spec, got, [spec.numel, 0])
    assert bits_equal(ref, got)
    base = torch.randn(spec.numel, generator=gen)
    reference.sum_payloads(out_ref, spec, base, ref[: spec.numel])
    cpu_kernels.sum_payloads(out_ref, spec, base, got[: spec.numel])
    assert bits_equal(ref, got)


def test_cpu_kernels_do_not_depend_on_thread_count(cpu_kernels):
    segments = ((100_000, True), (77, False), (65_537, True))
    spec = PayloadSpec(segments, 4, 1024, torch.float32, "stochastic", torch.float32)
    gen = torch.Generator().manual_seed(3)
    src = _chunk_data(spec, 3, gen)
    seeds = _seed_table([1, 2, 3], len(segments))
    offsets = [0, spec.numel, 2 * spec.numel]
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            blob = torch.empty(3 * spec.nbytes, dtype=torch.uint8)
            cpu_kernels.encode_payloads(src, spec, offsets, seeds, blob)
            total = torch.empty(spec.numel)
            cpu_kernels.sum_payloads(blob, spec, src[: spec.numel], total)
            results.append((blob, total))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0][0], results[1][0])
    assert bits_equal(results[0][1], results[1][1])


@pytest.mark.parametrize("segments", [(), ((0, True), (0, False)), ((5, False),), ((9, True),)], ids=str)
@pytest.mark.parametrize("slots", [0, 1, 3])
def test_empty_specs_and_slots(cpu_kernels, segments, slots):
    spec = PayloadSpec(segments, 5, 4, torch.float32, "stochastic", torch.bfloat16)
    gen = torch.Generator().manual_seed(slots)
    src = _chunk_data(spec, max(slots, 1), gen, special=False)
    seeds = _seed_table(list(range(slots)), len(segments))
    offsets = [spec.numel * s for s in range(slots)]
    out_ref, out_cpu = _encode_both(cpu_kernels, spec, src, offsets, seeds)
    assert out_ref.numel() == slots * spec.nbytes and torch.equal(out_ref, out_cpu)
    base = torch.randn(spec.numel, generator=gen).to(torch.bfloat16)
    ref, got = torch.empty(spec.numel), torch.empty(spec.numel)
    reference.sum_payloads(out_ref, spec, base, ref)
    cpu_kernels.sum_payloads(out_ref, spec, base, got)
    assert bits_equal(ref, got)
    if slots == 0:  # no payloads: the sum is the base, exactly
        assert torch.equal(got, base.float())


# -- reference == the per-segment path it replaces ----------------------------------------------------


@pytest.mark.parametrize("elem_dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("bits,bucket,meta,rounding", [(8, 1024, torch.float32, "stochastic"), (4, 128, torch.bfloat16, "stochastic"),
                                                       (3, 12, torch.float32, "nearest"), (2, 1, torch.bfloat16, "nearest")])  # fmt: skip
@pytest.mark.parametrize("backend", ["reference", "fused-default"])
def test_fused_calls_equal_per_segment_path(monkeypatch, elem_dtype, bits, bucket, meta, rounding, backend):
    """Same bytes as encode_chunk per slot, same values as decode_chunk per owner and the fp32 sum."""
    monkeypatch.setenv("QACCEL_KERNELS", "reference")  # the old path: one reference codec call per segment
    layout = PayloadLayout(SEGMENTS, WireCodec(bits, bucket, meta, rounding), elem_dtype)
    spec = PayloadSpec(SEGMENTS, bits, bucket, meta, rounding, elem_dtype)
    assert spec.nbytes == layout.nbytes
    slots, slot_seeds = 3, [5, 2**64 - 1, 123456789]
    gen = torch.Generator().manual_seed(bits)
    src = _chunk_data(spec, slots, gen)
    expected = torch.empty(slots * layout.nbytes, dtype=torch.uint8)
    for s in range(slots):
        encode_chunk(src[s * spec.numel : (s + 1) * spec.numel], layout, slot_seeds[s],
                     expected[s * layout.nbytes : (s + 1) * layout.nbytes])  # fmt: skip
    decoded = torch.empty(slots * spec.numel, dtype=elem_dtype)
    for s in range(slots):
        decode_chunk(expected[s * layout.nbytes : (s + 1) * layout.nbytes], layout, decoded[s * spec.numel : (s + 1) * spec.numel])
    base = src[: spec.numel]
    total = base.to(torch.float32, copy=True)
    for s in range(slots):
        decode_chunk(expected[s * layout.nbytes : (s + 1) * layout.nbytes], layout, total, accumulate=True)
    summed = total.to(elem_dtype)

    if backend == "fused-default":  # the public calls on this machine's default backend
        monkeypatch.delenv("QACCEL_KERNELS")
        encode, decode, add = encode_payloads, decode_payloads, sum_payloads
    else:
        encode, decode, add = reference.encode_payloads, reference.decode_payloads, reference.sum_payloads
    offsets = [s * spec.numel for s in range(slots)]
    blob = torch.empty(slots * spec.nbytes, dtype=torch.uint8)
    encode(src, spec, offsets, _seed_table(slot_seeds, len(SEGMENTS)), blob)
    assert torch.equal(blob, expected)
    got = torch.empty_like(decoded)
    decode(blob, spec, got, offsets)
    assert bits_equal(got, decoded)
    out = torch.empty(spec.numel, dtype=elem_dtype)
    add(blob, spec, base, out)
    assert bits_equal(out, summed)


def test_spec_layout_matches_payload_layout():
    """Offsets and sizes against the wire layout of qaccel.comm (an independent implementation)."""
    for segments in (SEGMENTS, ((3, False),), ((17, True), (1, False), (1, False))):
        for meta in (torch.float32, torch.bfloat16):
            for elem in DTYPES:
                layout = PayloadLayout(segments, WireCodec(3, 5, meta, "stochastic"), elem)
                spec = PayloadSpec(segments, 3, 5, meta, "stochastic", elem)
                assert (spec.numel, spec.nbytes, spec.code_bytes, spec.num_buckets, spec.raw_bytes, spec.meta_offset,
                        spec.raw_offset) == (layout.numel, layout.nbytes, layout.code_bytes, layout.num_buckets,
                                             layout.raw_bytes, layout.meta_offset, layout.raw_offset)  # fmt: skip
                table = spec.table()
                assert table.dtype == torch.int64 and table.numel() == 20 + 8 * len(segments)
                assert spec.table() is table  # built once


# -- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    ({"bits": 9}, "bits=9"), ({"bits": 1}, "bits=1"), ({"bucket_size": 0}, "bucket_size=0"),
    ({"rounding": "up"}, "rounding='up'"), ({"meta_dtype": torch.float16}, "meta_dtype"),
    ({"elem_dtype": torch.int32}, "elem_dtype"), ({"segments": [(3, True)]}, "tuple"),
    ({"segments": ((-1, True),)}, r"segments\[0\]"), ({"segments": ((3, 1),)}, r"segments\[0\]"),
])  # fmt: skip
def test_spec_rejects_bad_settings(kwargs, match):
    args = {"segments": ((4, True),), "bits": 4, "bucket_size": 8, "meta_dtype": torch.float32,
            "rounding": "stochastic", "elem_dtype": torch.float32, **kwargs}  # fmt: skip
    with pytest.raises(ValueError, match=match):
        PayloadSpec(**args)


def test_calls_reject_bad_input():
    spec = PayloadSpec(((20, True), (3, False)), 4, 8, torch.float32, "stochastic", torch.float32)
    src = torch.randn(2 * spec.numel)
    seeds = torch.zeros(2, 2, dtype=torch.int64)
    out = torch.empty(2 * spec.nbytes, dtype=torch.uint8)
    offsets = [0, spec.numel]
    with pytest.raises(TypeError, match="spec must be a qaccel.quant.PayloadSpec"):
        encode_payloads(src, "spec", offsets, seeds, out)
    with pytest.raises(TypeError, match="src.dtype=torch.bfloat16: must equal spec.elem_dtype"):
        encode_payloads(src.bfloat16(), spec, offsets, seeds, out)
    with pytest.raises(ValueError, match=r"seeds has shape \(2, 3\)"):
        encode_payloads(src, spec, offsets, torch.zeros(2, 3, dtype=torch.int64), out)
    with pytest.raises(TypeError, match="seeds must be an int64 tensor"):
        encode_payloads(src, spec, offsets, seeds.int(), out)
    with pytest.raises(ValueError, match=r"src_offsets has 1 entries, expected 2"):
        encode_payloads(src, spec, [0], seeds, out)
    with pytest.raises(ValueError, match=r"src_offsets\[1\]=24"):
        encode_payloads(src, spec, [0, 24], seeds, out)
    with pytest.raises(TypeError, match=r"src_offsets\[0\]=0.5"):
        encode_payloads(src, spec, [0.5, 0], seeds, out)
    with pytest.raises(ValueError, match="out has 10 bytes: expected slots"):
        encode_payloads(src, spec, offsets, seeds, out[:10])
    with pytest.raises(ValueError, match="4-byte aligned"):
        encode_payloads(src, spec, offsets, seeds, torch.empty(2 * spec.nbytes + 1, dtype=torch.uint8)[1:])
    with pytest.raises(ValueError, match="contiguous 1-D"):
        encode_payloads(src.view(2, -1), spec, offsets, seeds, out)
    with pytest.raises(ValueError, match="overlap in memory"):
        shared = torch.empty(2 * spec.numel * 4 + 2 * spec.nbytes, dtype=torch.uint8)
        encode_payloads(shared[: 2 * spec.numel * 4].view(torch.float32), spec, offsets, seeds, shared[4:][: 2 * spec.nbytes])
    with pytest.raises(ValueError, match="out_offsets 0 and 5 overlap"):
        decode_payloads(out, spec, torch.empty(3 * spec.numel), [0, 5])
    with pytest.raises(ValueError, match="blob has 10 bytes"):
        decode_payloads(out[:10], spec, torch.empty(2 * spec.numel), offsets)
    with pytest.raises(TypeError, match="out.dtype=torch.int32"):
        decode_payloads(out, spec, torch.empty(2 * spec.numel, dtype=torch.int32), offsets)
    with pytest.raises(ValueError, match="base has 22 elements"):
        sum_payloads(out, spec, torch.empty(spec.numel - 1), torch.empty(spec.numel))
    with pytest.raises(ValueError, match="multiple of spec.nbytes"):
        sum_payloads(out[:-4], spec, torch.empty(spec.numel), torch.empty(spec.numel))
    with pytest.raises(ValueError, match="base and out overlap"):
        buffer = torch.empty(spec.numel + 1)
        sum_payloads(out, spec, buffer[1:], buffer[:-1])


# -- CUDA (runs where a GPU is present; scripts/gpu_check.py covers more layouts and the speed) -------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("elem_dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("bits,bucket,meta,rounding", [(8, 64, torch.float32, "stochastic"), (3, 12, torch.bfloat16, "nearest"),
                                                       (5, 5000, torch.float32, "stochastic")])  # fmt: skip
def test_cuda_kernels_match_reference(elem_dtype, bits, bucket, meta, rounding):
    problem = _native.describe("cuda")["toolchain_problem"]
    if problem is not None:
        pytest.skip(f"CUDA kernels cannot be built here: {problem}")
    kernels = _native.load("cuda")
    spec = PayloadSpec(SEGMENTS + ((20000, True),), bits, bucket, meta, rounding, elem_dtype)
    slots = 3
    gen = torch.Generator().manual_seed(bits)
    src = torch.cat([torch.randn(1).to(elem_dtype), _chunk_data(spec, slots, gen)]).cuda()
    offsets = [1 + spec.numel * s for s in (2, 0, 1)]
    seeds = torch.randint(-(2**63), 2**63 - 1, (slots, len(spec.segments)), generator=gen, dtype=torch.int64)
    blob_ref = torch.full((slots * spec.nbytes,), 0xAB, dtype=torch.uint8, device="cuda")
    blob = torch.full_like(blob_ref, 0xCD)
    reference.encode_payloads(src, spec, offsets, seeds, blob_ref)
    kernels.encode_payloads(src, spec, offsets, seeds, blob)
    assert torch.equal(blob, blob_ref)
    for out_dtype in DTYPES:
        ref = torch.full((1 + slots * spec.numel,), 7.0, dtype=out_dtype, device="cuda")
        got = ref.clone()
        out_offsets = [1 + spec.numel * s for s in (1, 2, 0)]
        reference.decode_payloads(blob_ref, spec, ref, out_offsets)
        kernels.decode_payloads(blob_ref, spec, got, out_offsets)
        assert bits_equal(ref, got), out_dtype
        base = torch.randn(spec.numel, generator=gen).to(out_dtype).cuda()
        ref_sum, got_sum = torch.empty_like(base), base.clone()
        reference.sum_payloads(blob_ref, spec, base, ref_sum)
        kernels.sum_payloads(blob_ref, spec, got_sum, got_sum)  # in place, as the reduce-scatter may
        assert bits_equal(ref_sum, got_sum), out_dtype
