"""Wire payload of one rank-chunk: size against the codec, error bounds per segment, raw segments exact.

Size oracle: the codec's own ``quantize(segment).nbytes`` for every quantized segment plus the raw
bytes of the others, i.e. what the segments weigh when each is quantized on its own, independent
of how the payload lays them out. The payload may add alignment padding and nothing else: at most
3 bytes after the codes and 3 after the raw segments.
"""

import math

import pytest
import torch

from qaccel.comm import PayloadLayout, WireCodec, decode_chunk, encode_chunk, mix_seed
from qaccel.fsdp import UnitPlan
from qaccel.quant import quantize

MAX_ALIGNMENT_PADDING = 6


def codec_bytes(x, segments, codec):
    """Bytes of the segments quantized one by one (codes + metadata) plus the raw ones."""
    total, offset = 0, 0
    for numel, quantized in segments:
        segment = x[offset : offset + numel]
        if quantized:
            total += quantize(segment, codec.bits, codec.bucket_size, codec.rounding, 0, codec.meta_dtype).nbytes
        else:
            total += segment.numel() * segment.element_size()
        offset += numel
    return total


def assert_payload_size(layout, x):
    expected = codec_bytes(x, layout.segments, layout.codec)
    assert expected <= layout.nbytes <= expected + MAX_ALIGNMENT_PADDING, (layout.nbytes, expected)


def bucket_units(x, segments, bucket, bits):
    """Per element: (max - min) / (2**bits - 1) of its own bucket; buckets restart per segment."""
    units = torch.zeros_like(x)
    offset = 0
    for numel, quantized in segments:
        if quantized:
            for start in range(offset, offset + numel, bucket):
                end = min(start + bucket, offset + numel)
                chunk = x[start:end]
                units[start:end] = (chunk.max() - chunk.min()) / (2**bits - 1)
        offset += numel
    return units


@pytest.mark.parametrize("bits,bucket,meta", [(8, 1024, torch.float32), (4, 128, torch.bfloat16), (3, 64, torch.float32), (2, 16, torch.bfloat16)])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_payload_size_error_bound_and_raw_exact(bits, bucket, meta, rounding):
    gen = torch.Generator().manual_seed(bits)
    # A weight-like segment, a LayerNorm-like raw segment (~1), an odd-length weight segment.
    segments = ((3000, True), (37, False), (1029, True))
    x = torch.cat([torch.randn(3000, generator=gen) * 0.02, 1 + 0.01 * torch.randn(37, generator=gen), torch.randn(1029, generator=gen)])
    layout = PayloadLayout(segments=segments, codec=WireCodec(bits, bucket, meta, rounding), elem_dtype=torch.float32)
    assert_payload_size(layout, x)
    blob = torch.empty(layout.nbytes, dtype=torch.uint8)
    encode_chunk(x, layout, seed=5, out=blob)
    decoded = decode_chunk(blob, layout, torch.empty_like(x))
    units = bucket_units(x, segments, bucket, bits)
    # bf16 metadata rounds scale up by at most one bf16 ulp (2**-8 relative) and lo down.
    slack = 1.02 if meta == torch.bfloat16 else 1.0 + 1e-6
    limit = (0.5 if rounding == "nearest" else 1.0) * units * slack + 1e-7 * x.abs() + 1e-30
    err = (decoded - x).abs()
    assert torch.all(err <= limit), f"max excess {(err - limit).max()}"
    raw = slice(3000, 3037)
    assert torch.equal(decoded[raw], x[raw])
    # Buckets restart at segment boundaries: the small weights keep a grid of their own scale.
    assert err[:3000].max() < 0.02 * 8 / (2**bits - 1)


def test_accumulate_adds_in_fp32_and_padding_is_deterministic():
    segments = ((40, True), (3, False))
    layout = PayloadLayout(segments=segments, codec=WireCodec(4, 16, torch.float32), elem_dtype=torch.float32)
    x = torch.linspace(-1, 1, 43)
    blob_a = encode_chunk(x, layout, 9, torch.full((layout.nbytes,), 255, dtype=torch.uint8))
    blob_b = encode_chunk(x, layout, 9, torch.zeros(layout.nbytes, dtype=torch.uint8))
    assert torch.equal(blob_a, blob_b)
    base = torch.full((43,), 10.0)
    decoded = decode_chunk(blob_a, layout, torch.empty(43))
    total = decode_chunk(blob_a, layout, base.clone(), accumulate=True)
    assert torch.allclose(total, base + decoded, rtol=0, atol=1e-6)


def test_bf16_buffer_round_trip():
    segments = ((2048, True), (64, False))
    layout = PayloadLayout(segments=segments, codec=WireCodec(8, 1024, torch.float32), elem_dtype=torch.bfloat16)
    x = torch.randn(2112).to(torch.bfloat16)
    assert_payload_size(layout, x)
    decoded = decode_chunk(encode_chunk(x, layout, 1, torch.empty(layout.nbytes, dtype=torch.uint8)), layout, torch.empty_like(x))
    assert torch.equal(decoded[2048:], x[2048:])
    units = bucket_units(x.float(), segments, 1024, 8)
    # decoded values are rounded to bf16 once more: allow half a bf16 ulp on top of one unit
    assert torch.all((decoded.float() - x.float()).abs() <= units + x.float().abs() * 2**-8 + 1e-6)


def test_seeds_change_codes_and_are_reproducible():
    layout = PayloadLayout(segments=((4096, True),), codec=WireCodec(4, 128, torch.float32), elem_dtype=torch.float32)
    x = torch.randn(4096)

    def enc(seed):
        return encode_chunk(x, layout, seed, torch.empty(layout.nbytes, dtype=torch.uint8))

    assert torch.equal(enc(mix_seed(1, 2, 3)), enc(mix_seed(1, 2, 3)))
    assert not torch.equal(enc(mix_seed(1, 2, 3)), enc(mix_seed(1, 2, 4)))
    assert len({mix_seed(0, step, unit) for step in range(50) for unit in range(50)}) == 2500


def test_unit_plan_segment_map():
    shapes = [torch.Size([64, 192]), torch.Size([192]), torch.Size([64]), torch.Size([10, 10]), torch.Size([64, 64])]
    world = 2
    numels = [math.ceil(s[0] / world) * math.prod(s[1:]) for s in shapes]
    plan = UnitPlan.build(0, "u", shapes, numels, param_min_numel=1024, unit_min_numel=100)
    # 1-D and small (100 < 1024) parameters are raw; adjacent raw ones merge into one segment.
    assert plan.segments == ((6144, True), (96 + 32 + 50, False), (2048, True))
    assert plan.enabled
    assert not UnitPlan.build(0, "u", shapes, numels, param_min_numel=1024, unit_min_numel=10_000).enabled
    assert not UnitPlan.build(0, "u", shapes[1:3], numels[1:3], param_min_numel=0, unit_min_numel=0).enabled


@pytest.mark.parametrize(
    "segments",
    [((37, True),), ((5, False), (1, True)), ((1029, True), (3, False), (9, True), (1, False)), ((0, True), (13, True))],
    ids=str,
)
@pytest.mark.parametrize("elem_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [3, 5, 8])
def test_odd_lengths_cost_the_codec_bytes_plus_alignment_only(segments, elem_dtype, bits):
    layout = PayloadLayout(segments=segments, codec=WireCodec(bits, 16, torch.bfloat16), elem_dtype=elem_dtype)
    x = torch.randn(sum(n for n, _ in segments)).to(elem_dtype)
    assert_payload_size(layout, x)
    decoded = decode_chunk(encode_chunk(x, layout, 3, torch.empty(layout.nbytes, dtype=torch.uint8)), layout, torch.empty_like(x))
    offset = 0
    for numel, quantized in segments:
        if not quantized:
            assert torch.equal(decoded[offset : offset + numel], x[offset : offset + numel])
        offset += numel
