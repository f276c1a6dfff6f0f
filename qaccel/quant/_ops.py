"""The codec ops: schemas declared once, their fake kernels, and the reference as the default kernel.

One registration serves every backend, as in torchao (``TORCH_LIBRARY_FRAGMENT`` plus
``TORCH_LIBRARY_IMPL`` per device) and bitsandbytes (``_ops.py``: ``torch.library.define`` and
``register_fake`` once, a ``"default"`` pure-torch kernel, per-device overrides):

- the schemas of the ``qaccel`` namespace are defined here, in Python, so they exist whether or not a
  native library ever loads (no compiler, ``QACCEL_KERNELS=reference``);
- the pure-torch :mod:`qaccel.quant.reference` is the ``CompositeExplicitAutograd`` kernel, the one
  any device without a native kernel runs;
- ``qaccel/csrc/quant_cpu.cpp`` and ``quant_cuda_binding.cpp`` add their kernels for the ``CPU`` and
  ``CUDA`` dispatch keys (``TORCH_LIBRARY_IMPL(qaccel, CPU/CUDA, m)``, the op list in
  ``quant_ops.h``) when :mod:`qaccel.quant._native` loads them; the dispatcher checks their C++
  signatures against these schemas at load time;
- the fake kernels give output shapes and dtypes without computing, so the ops run under
  ``FakeTensorMode`` and ``torch.compile(fullgraph=True)`` traces through them.

Ops that write into a tensor (``Tensor(a!)``) return nothing, which torch.compile's
auto-functionalization needs; the wrappers at the end restore the reference's signatures (they take a
:class:`~qaccel.quant.PayloadSpec`, a list of offsets and an unsigned seed, and return ``out``) and
are what a native backend's kernels module exposes. Seeds cross the schema as the int64 bit pattern
of the unsigned 64-bit seed (:func:`qaccel.quant._rng.seed_bits`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import reference
from ._payload import PayloadSpec
from ._rng import normalize_seed, seed_bits

__all__ = [
    "NAMESPACE",
    "SCHEMAS",
    "quantize_buckets",
    "dequantize_into",
    "sign_pack",
    "sign_unpack",
    "encode_payloads",
    "decode_payloads",
    "sum_payloads",
    "onebit_encode",
    "onebit_server",
]

NAMESPACE = "qaccel"
# `table`: the PayloadSpec table on the CPU (launch parameters); `device_table`: the same table on the
# data's device (what the kernels read; the CPU table itself for CPU data).
SCHEMAS = {
    "quantize_buckets": "(Tensor x, int bits, int bucket_size, bool nearest, int seed, ScalarType meta_dtype)"
    " -> (Tensor, Tensor, Tensor)",
    "dequantize_into": "(Tensor codes, Tensor lo, Tensor scale, int bits, int bucket_size, Tensor(a!) out,"
    " bool accumulate) -> ()",
    "sign_pack": "(Tensor x, int chunks) -> Tensor",
    "sign_unpack": "(Tensor signs, Tensor scales, int numel, Tensor(a!) out) -> ()",
    "encode_payloads": "(Tensor src, Tensor table, Tensor device_table, Tensor src_offsets, Tensor seeds,"
    " Tensor(a!) out) -> ()",
    "decode_payloads": "(Tensor blob, Tensor table, Tensor device_table, Tensor(a!) out, Tensor out_offsets,"
    " Tensor? seeds) -> ()",
    "sum_payloads": "(Tensor blob, Tensor table, Tensor device_table, Tensor base, Tensor(a!) out,"
    " Tensor? seeds) -> ()",
    "onebit_encode": "(Tensor x, Tensor(a!) error, int chunks) -> (Tensor, Tensor)",
    "onebit_server": "(Tensor signs, Tensor scales, Tensor(a!) error, int chunks) -> (Tensor, Tensor)",
}

_LIBRARY = torch.library.Library(NAMESPACE, "DEF")  # the namespace is ours: defined once per process
for _name, _schema in SCHEMAS.items():
    _LIBRARY.define(_name + _schema)


# -- the reference: the default kernel of every device -------------------------------------------------


def _reference_quantize(x, bits, bucket_size, nearest, seed, meta_dtype):
    return reference.quantize_buckets(x, bits, bucket_size, nearest, normalize_seed(seed), meta_dtype)


def _reference_dequantize(codes, lo, scale, bits, bucket_size, out, accumulate) -> None:
    reference.dequantize_into(codes, lo, scale, bits, bucket_size, out, accumulate)


def _reference_sign_unpack(signs, scales, numel, out) -> None:
    reference.sign_unpack(signs, scales, numel, out)


def _reference_encode(src, table, device_table, src_offsets, seeds, out) -> None:
    reference.encode_payloads(src, PayloadSpec.from_table(table), src_offsets.tolist(), seeds, out)


def _reference_decode(blob, table, device_table, out, out_offsets, seeds) -> None:
    reference.decode_payloads(blob, PayloadSpec.from_table(table), out, out_offsets.tolist(), seeds)


def _reference_sum(blob, table, device_table, base, out, seeds) -> None:
    reference.sum_payloads(blob, PayloadSpec.from_table(table), base, out, seeds)


_REFERENCE_KERNELS = {
    "quantize_buckets": _reference_quantize,
    "dequantize_into": _reference_dequantize,
    "sign_pack": reference.sign_pack,
    "sign_unpack": _reference_sign_unpack,
    "encode_payloads": _reference_encode,
    "decode_payloads": _reference_decode,
    "sum_payloads": _reference_sum,
    "onebit_encode": reference.onebit_encode,
    "onebit_server": reference.onebit_server,
}
for _name, _kernel in _REFERENCE_KERNELS.items():
    _LIBRARY.impl(_name, _kernel, "CompositeExplicitAutograd")


# -- fake kernels: shapes and dtypes only ---------------------------------------------------------------


def _fake_quantize(x, bits, bucket_size, nearest, seed, meta_dtype):
    numel = x.numel()
    buckets = (numel + bucket_size - 1) // bucket_size
    codes = x.new_empty((bits * ((numel + 7) // 8),), dtype=torch.uint8)
    return codes, x.new_empty((buckets,), dtype=meta_dtype), x.new_empty((buckets,), dtype=meta_dtype)


def _fake_sign_pack(x, chunks):
    # chunks whole bytes per chunk; 0 for an empty x (its chunks have no elements)
    return x.new_empty((chunks * ((x.numel() // chunks + 7) // 8),), dtype=torch.uint8)


def _fake_onebit(error, chunks):
    # the compressed compensated buffer: chunks whole bytes per chunk and one fp32 scale per chunk
    signs = error.new_empty((chunks * ((error.numel() // chunks + 7) // 8),), dtype=torch.uint8)
    return signs, error.new_empty((chunks,), dtype=torch.float32)


def _fake_writes_into_out(*args) -> None:
    """The ops that write into ``out`` create no tensor: nothing to describe."""


_FAKE_KERNELS = {
    "quantize_buckets": _fake_quantize,
    "sign_pack": _fake_sign_pack,
    "onebit_encode": lambda x, error, chunks: _fake_onebit(error, chunks),
    "onebit_server": lambda signs, scales, error, chunks: _fake_onebit(error, chunks),
}
for _name in SCHEMAS:
    torch.library.register_fake(f"{NAMESPACE}::{_name}", _FAKE_KERNELS.get(_name, _fake_writes_into_out), lib=_LIBRARY)


# -- the reference's signatures over the ops (a native backend's kernels module) ------------------------


# The overloads themselves: calling one skips the packet's overload resolution (about 1 us a call).
_QUANTIZE = torch.ops.qaccel.quantize_buckets.default
_DEQUANTIZE = torch.ops.qaccel.dequantize_into.default
_SIGN_PACK = torch.ops.qaccel.sign_pack.default
_SIGN_UNPACK = torch.ops.qaccel.sign_unpack.default
_ENCODE = torch.ops.qaccel.encode_payloads.default
_DECODE = torch.ops.qaccel.decode_payloads.default
_SUM = torch.ops.qaccel.sum_payloads.default
_ONEBIT_ENCODE = torch.ops.qaccel.onebit_encode.default
_ONEBIT_SERVER = torch.ops.qaccel.onebit_server.default


def _flat(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1)
    return flat if flat.is_contiguous() else flat.contiguous()


def _offsets_tensor(offsets: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Per-slot element offsets as a CPU int64 tensor (the fused payload calls take a list or a tensor)."""
    if isinstance(offsets, torch.Tensor):
        return offsets.detach().to("cpu", torch.int64).reshape(-1).contiguous()
    return torch.tensor(list(offsets), dtype=torch.int64)


def quantize_buckets(
    x: torch.Tensor, bits: int, bucket_size: int, nearest: bool, seed: int, meta_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    codes, lo, scale = _QUANTIZE(_flat(x), bits, bucket_size, bool(nearest), seed_bits(seed), meta_dtype)
    return codes, lo, scale


def dequantize_into(
    codes: torch.Tensor,
    lo: torch.Tensor,
    scale: torch.Tensor,
    bits: int,
    bucket_size: int,
    out: torch.Tensor,
    accumulate: bool,
) -> torch.Tensor:
    _DEQUANTIZE(codes, lo, scale, bits, bucket_size, out, bool(accumulate))
    return out


def sign_pack(x: torch.Tensor, chunks: int) -> torch.Tensor:
    return _SIGN_PACK(_flat(x), chunks)


def sign_unpack(signs: torch.Tensor, scales: torch.Tensor, numel: int, out: torch.Tensor) -> torch.Tensor:
    _SIGN_UNPACK(signs, scales, numel, out)
    return out


def encode_payloads(
    src: torch.Tensor, spec: PayloadSpec, src_offsets: Sequence[int] | torch.Tensor, seeds: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    _ENCODE(src, spec.table("cpu"), spec.table(src.device), _offsets_tensor(src_offsets), seeds, out)
    return out


def decode_payloads(
    blob: torch.Tensor,
    spec: PayloadSpec,
    out: torch.Tensor,
    out_offsets: Sequence[int] | torch.Tensor,
    seeds: torch.Tensor | None = None,
) -> torch.Tensor:
    _DECODE(blob, spec.table("cpu"), spec.table(out.device), out, _offsets_tensor(out_offsets), seeds)
    return out


def sum_payloads(
    blob: torch.Tensor, spec: PayloadSpec, base: torch.Tensor, out: torch.Tensor, seeds: torch.Tensor | None = None
) -> torch.Tensor:
    _SUM(blob, spec.table("cpu"), spec.table(out.device), base, out, seeds)
    return out


def onebit_encode(x: torch.Tensor, error: torch.Tensor, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    signs, scales = _ONEBIT_ENCODE(_flat(x), error, chunks)
    return signs, scales


def onebit_server(
    signs: torch.Tensor, scales: torch.Tensor, error: torch.Tensor, chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    new_signs, new_scales = _ONEBIT_SERVER(_flat(signs), scales, error, chunks)
    return new_signs, new_scales


# The reference's docstrings state what each computes (bit for bit the same).
for _wrapper in (quantize_buckets, dequantize_into, sign_pack, sign_unpack, encode_payloads, decode_payloads,
                 sum_payloads, onebit_encode, onebit_server):  # fmt: skip
    _wrapper.__doc__ = getattr(reference, _wrapper.__name__).__doc__
