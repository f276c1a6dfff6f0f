"""The codec ops (``torch.ops.qaccel.*``): one schema per op, fake kernels, torch.compile, the reference default.

Oracles: :mod:`qaccel.quant.reference` called directly (plain Python functions, not the ops) for
values, shapes and dtypes; the dispatcher's own registry for which kernels are registered; the
C++ sources for the op list each backend registers.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from qaccel.quant import PayloadSpec, _native, _ops, reference
from tests._codec_checks import bits_equal

OPS = tuple(_ops.SCHEMAS)
SEED = 2**64 - 3  # above 2**63: crosses the schema's signed int as a negative bit pattern
SPEC = PayloadSpec(((300, True), (7, False), (41, True)), 4, 32, torch.bfloat16, "stochastic", torch.float32)
ROTATED = PayloadSpec(((300, True), (7, False)), 5, 64, torch.float32, "nearest", torch.float32, "hadamard")


def _data(numel: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 3


def _seeds(spec: PayloadSpec, slots: int) -> torch.Tensor:
    return torch.randint(-(2**63), 2**63 - 1, (slots, len(spec.segments)), generator=torch.Generator().manual_seed(5))


# -- one op list ----------------------------------------------------------------------------------------


def test_every_backend_registers_exactly_the_declared_ops():
    header = (_native.CSRC / "quant_ops.h").read_text()
    assert set(re.findall(r'\.impl\("(\w+)"', header)) == set(OPS) and len(OPS) == 9
    for source, key in (("quant_cpu.cpp", "CPU"), ("quant_cuda_binding.cpp", "CUDA")):
        text = (_native.CSRC / source).read_text()
        assert f"TORCH_LIBRARY_IMPL(qaccel, {key}, m) {{ QACCEL_IMPL_CODEC_OPS(m); }}" in text, source
        assert "PYBIND11_MODULE" not in text and "m.def(" not in text, source


def test_the_cpu_library_registers_cpu_kernels_for_every_op(cpu_kernels):
    for name in OPS:
        qualified = f"qaccel::{name}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CPU"), name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CompositeExplicitAutograd"), name
        if not torch.cuda.is_available():
            assert not torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CUDA"), name


def test_a_spec_is_read_back_from_its_table():
    for spec in (SPEC, ROTATED, PayloadSpec((), 8, 1), PayloadSpec(((5, False),), 2, 3, elem_dtype=torch.float16)):
        assert PayloadSpec.from_table(spec.table()) == spec
    with pytest.raises(ValueError, match="do not form a header"):
        PayloadSpec.from_table(SPEC.table()[:-1])


# -- fake tensors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("numel,bits,bucket,meta", [(0, 4, 8, torch.float32), (1, 2, 1, torch.bfloat16),
                                                    (1000, 3, 64, torch.float32), (4097, 8, 1000, torch.bfloat16)])  # fmt: skip
def test_quantize_under_fake_tensors_has_the_reference_shapes(numel, bits, bucket, meta):
    expected = reference.quantize_buckets(_data(numel), bits, bucket, False, SEED, meta)
    with FakeTensorMode() as mode:
        x = mode.from_tensor(_data(numel))
        got = torch.ops.qaccel.quantize_buckets(x, bits, bucket, False, -3, meta)
    assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in expected]


@pytest.mark.parametrize("numel,chunks", [(0, 1), (8, 1), (12, 4), (1001, 7), (4096, 2)])
def test_sign_pack_under_fake_tensors_has_the_reference_shape(numel, chunks):
    expected = reference.sign_pack(_data(numel), chunks)
    with FakeTensorMode() as mode:
        got = torch.ops.qaccel.sign_pack(mode.from_tensor(_data(numel)), chunks)
    assert (got.shape, got.dtype) == (expected.shape, expected.dtype)


@pytest.mark.parametrize("numel,padded,chunks", [(1, 8, 1), (700, 704, 4), (4096, 4096, 2)])
def test_onebit_ops_under_fake_tensors_have_the_reference_shapes(numel, padded, chunks):
    expected = reference.onebit_encode(_data(numel), torch.zeros(padded), chunks)
    signs = reference.sign_pack(_data(3 * padded), 3)
    expected_server = reference.onebit_server(signs, torch.ones(3), torch.zeros(padded), chunks)
    with FakeTensorMode() as mode:
        got = torch.ops.qaccel.onebit_encode(mode.from_tensor(_data(numel)), mode.from_tensor(torch.zeros(padded)), chunks)
        got_server = torch.ops.qaccel.onebit_server(
            mode.from_tensor(signs), mode.from_tensor(torch.ones(3)), mode.from_tensor(torch.zeros(padded)), chunks
        )
    for have, want in ((got, expected), (got_server, expected_server)):
        assert [(t.shape, t.dtype) for t in have] == [(t.shape, t.dtype) for t in want]


def test_ops_that_write_into_out_run_under_fake_tensors():
    slots = 2
    with FakeTensorMode() as mode:
        src = mode.from_tensor(_data(slots * SPEC.numel))
        blob = mode.from_tensor(torch.empty(slots * SPEC.nbytes, dtype=torch.uint8))
        out = mode.from_tensor(torch.empty(slots * SPEC.numel))
        table, offsets = mode.from_tensor(SPEC.table()), mode.from_tensor(torch.tensor([0, SPEC.numel]))
        assert torch.ops.qaccel.encode_payloads(src, table, table, offsets, mode.from_tensor(_seeds(SPEC, 2)), blob) is None
        torch.ops.qaccel.decode_payloads(blob, table, table, out, offsets, None)
        torch.ops.qaccel.sum_payloads(blob, table, table, out[: SPEC.numel], out[SPEC.numel :], None)
        codes, lo, scale = torch.ops.qaccel.quantize_buckets(src, 4, 64, True, 0, torch.float32)
        torch.ops.qaccel.dequantize_into(codes, lo, scale, 4, 64, out, True)
    assert (out.shape, out.dtype, blob.shape) == ((slots * SPEC.numel,), torch.float32, (slots * SPEC.nbytes,))


# -- torch.compile --------------------------------------------------------------------------------------


def test_compiled_round_trip_is_bit_identical_to_the_eager_reference(cpu_kernels):
    x = _data(5000, seed=1)

    def round_trip(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        codes, lo, scale = torch.ops.qaccel.quantize_buckets(x, 3, 100, False, -3, torch.bfloat16)
        out = torch.empty_like(x)
        torch.ops.qaccel.dequantize_into(codes, lo, scale, 3, 100, out, False)  # auto-functionalized
        return codes, lo, scale, out, torch.ops.qaccel.sign_pack(x, 5)

    compiled = torch.compile(round_trip, fullgraph=True)(x)
    codes, lo, scale = reference.quantize_buckets(x, 3, 100, False, SEED, torch.bfloat16)
    decoded = reference.dequantize_into(codes, lo, scale, 3, 100, torch.empty_like(x), False)
    for got, expected in zip(compiled, (codes, lo, scale, decoded, reference.sign_pack(x, 5)), strict=True):
        assert bits_equal(got, expected)


def test_compiled_payload_ops_are_bit_identical_to_the_eager_reference(cpu_kernels):
    slots, seeds = 3, _seeds(SPEC, 3)
    src = _data(slots * SPEC.numel, seed=2)
    offsets = torch.tensor([SPEC.numel * s for s in (2, 0, 1)])
    table = SPEC.table()

    def encode_then_sum(src: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        blob = torch.zeros(slots * SPEC.nbytes, dtype=torch.uint8)
        torch.ops.qaccel.encode_payloads(src, table, table, offsets, seeds, blob)
        out = torch.empty_like(base)
        torch.ops.qaccel.sum_payloads(blob, table, table, base, out, None)
        return blob, out

    base = _data(SPEC.numel, seed=3)
    blob, total = torch.compile(encode_then_sum, fullgraph=True)(src, base)
    expected_blob = reference.encode_payloads(src, SPEC, offsets.tolist(), seeds, torch.empty_like(blob))
    assert bits_equal(blob, expected_blob)
    assert bits_equal(total, reference.sum_payloads(expected_blob, SPEC, base, torch.empty_like(base)))


# -- opcheck: schema, fake kernel and aot dispatch agree with the kernels ---------------------------------


def _opcheck_cases() -> dict[str, tuple]:
    x, slots = _data(700, seed=4), 2
    codes, lo, scale = reference.quantize_buckets(x, 5, 64, False, 9, torch.float32)
    src = _data(slots * ROTATED.numel, seed=6)
    seeds, offsets = _seeds(ROTATED, slots), torch.tensor([ROTATED.numel, 0])
    blob = reference.encode_payloads(src, ROTATED, offsets.tolist(), seeds, torch.empty(slots * ROTATED.nbytes, dtype=torch.uint8))
    table = ROTATED.table()
    return {
        "quantize_buckets": (x, 5, 64, False, -7, torch.bfloat16),
        "dequantize_into": (codes, lo, scale, 5, 64, torch.ones(700), True),
        "sign_pack": (x, 7),
        "sign_unpack": (reference.sign_pack(x, 7), reference.chunk_rms(x, 7), 700, torch.empty(700)),
        "encode_payloads": (src, table, table, offsets, seeds, torch.empty_like(blob)),
        "decode_payloads": (blob, table, table, torch.empty(slots * ROTATED.numel), offsets, seeds),
        "sum_payloads": (blob, table, table, _data(ROTATED.numel), torch.empty(ROTATED.numel), seeds),
        "onebit_encode": (x.to(torch.bfloat16), _data(704, seed=7) * 0.1, 8),
        "onebit_server": (reference.sign_pack(_data(3 * 704, seed=8), 3), torch.tensor([0.5, 2.0, 0.25]),
                          _data(704, seed=9), 2),
    }


@pytest.mark.parametrize("name", OPS)
def test_opcheck(cpu_kernels, name):
    torch.library.opcheck(getattr(torch.ops.qaccel, name).default, _opcheck_cases()[name])


# -- the reference is the default kernel -------------------------------------------------------------------

_REFERENCE_DEFAULT_SCRIPT = textwrap.dedent(
    """
    import torch
    from qaccel.quant import PayloadSpec, reference
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("qaccel::quantize_buckets", "CPU")
    x = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    got = torch.ops.qaccel.quantize_buckets(x, 6, 128, False, -3, torch.bfloat16)
    expected = reference.quantize_buckets(x, 6, 128, False, 2**64 - 3, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    spec = PayloadSpec(((1000, True), (9, False), (500, True)), 3, 40, torch.float32, "nearest", torch.float32, "hadamard")
    src = torch.randn(2 * spec.numel, generator=torch.Generator().manual_seed(1))
    seeds = torch.tensor([[5, -1, 2**62], [-(2**63), 0, 7]])
    blob = torch.empty(2 * spec.nbytes, dtype=torch.uint8)
    torch.ops.qaccel.encode_payloads(src, spec.table(), spec.table(), torch.tensor([spec.numel, 0]), seeds, blob)
    expected_blob = reference.encode_payloads(src, spec, [spec.numel, 0], seeds, torch.empty_like(blob))
    assert torch.equal(blob, expected_blob)
    out = torch.empty(2 * spec.numel)
    torch.ops.qaccel.decode_payloads(blob, spec.table(), spec.table(), out, torch.tensor([0, spec.numel]), seeds)
    expected = reference.decode_payloads(blob, spec, torch.empty_like(out), [0, spec.numel], seeds)
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))
    print("REFERENCE-DEFAULT-OK")
    """
)


def test_without_a_native_library_the_ops_run_the_reference(tmp_path):
    env = {**os.environ, "QACCEL_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", _REFERENCE_DEFAULT_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=300, check=False)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "REFERENCE-DEFAULT-OK" in result.stdout
    assert not os.listdir(tmp_path), "calling an op must not build anything"
