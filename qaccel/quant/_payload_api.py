"""Fused payload codecs: one native call encodes, decodes or sums every segment of every slot.

A QSDP collective moves one payload (:class:`~qaccel.quant.PayloadSpec`) per rank. Encoding or
decoding them segment by segment costs one kernel launch (or one parallel region) and a few
temporary tensors per segment and slot; these functions do the whole collective's worth in one
call, writing straight into the send buffer or the output. Results are byte for byte those of
quantizing each segment on its own with :func:`qaccel.quant.quantize` (``docs/qsdp.md``,
"Fused payload kernels").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _backend
from ._payload import PayloadSpec

__all__ = ["encode_payloads", "decode_payloads", "sum_payloads"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_spec(name: str, spec: object) -> PayloadSpec:
    if not isinstance(spec, PayloadSpec):
        raise TypeError(f"{name}: spec must be a qaccel.quant.PayloadSpec, got {type(spec).__name__}")
    return spec


def _check_flat(name: str, what: str, t: object, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: {what}.dtype={t.dtype}: must be one of {allowed}")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name}: {what} must be a contiguous 1-D tensor, got shape {tuple(t.shape)} "
                         f"(contiguous={t.is_contiguous()})")  # fmt: skip
    return t


def _check_aligned(name: str, what: str, t: torch.Tensor) -> None:
    # Metadata and raw elements are read in place as fp32/bf16 words.
    if t.numel() and t.data_ptr() % 4:
        raise ValueError(f"{name}: {what} must start at a 4-byte aligned address (a payload boundary)")


def _check_device(name: str, what: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name}: {what} is on {t.device}, expected {device} like the other tensors")


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _check_disjoint(name: str, a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return
    (a0, a1), (b0, b1) = _span(a), _span(b)
    if a0 < b1 and b0 < a1:
        raise ValueError(f"{name}: {a_name} and {b_name} overlap in memory; they must be separate buffers")


def _offsets(name: str, what: str, offsets: object, slots_hint: int | None, numel: int, limit: int) -> list[int]:
    """Validate per-slot element offsets: ints, each chunk inside ``[0, limit)``."""
    if isinstance(offsets, torch.Tensor):
        if offsets.dim() != 1 or offsets.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name}: {what} as a tensor must be 1-D int64/int32, got {offsets.dtype} {tuple(offsets.shape)}")
        values = [int(v) for v in offsets.tolist()]
    elif isinstance(offsets, Sequence) and not isinstance(offsets, (str, bytes)):
        values = list(offsets)
        for slot, value in enumerate(values):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: {what}[{slot}]={value!r}: must be an int")
    else:
        raise TypeError(f"{name}: {what} must be a sequence of ints or a 1-D integer tensor, got {type(offsets).__name__}")
    if slots_hint is not None and len(values) != slots_hint:
        raise ValueError(f"{name}: {what} has {len(values)} entries, expected {slots_hint} (one per slot)")
    for slot, value in enumerate(values):
        if value < 0 or value + numel > limit:
            raise ValueError(f"{name}: {what}[{slot}]={value}: the chunk [{value}, {value + numel}) must lie inside "
                             f"the {limit} elements of the tensor")  # fmt: skip
    return values


def _check_seeds(name: str, seeds: object, spec: PayloadSpec, slots: int | None, device: torch.device) -> None:
    """``seeds``: int64 ``[slots, segments]`` on the CPU or ``device``."""
    if not isinstance(seeds, torch.Tensor) or seeds.dtype != torch.int64 or seeds.dim() != 2:
        got = f"{seeds.dtype} {tuple(seeds.shape)}" if isinstance(seeds, torch.Tensor) else type(seeds).__name__
        raise TypeError(f"{name}: seeds must be an int64 tensor [slots, {len(spec.segments)}], got {got}")
    if seeds.shape[1] != len(spec.segments) or (slots is not None and seeds.shape[0] != slots):
        expected = "slots" if slots is None else str(slots)
        raise ValueError(f"{name}: seeds has shape {tuple(seeds.shape)}: expected [{expected}, {len(spec.segments)}] "
                         "(one seed per slot and segment)")  # fmt: skip
    if seeds.device.type != "cpu" and seeds.device != device:
        raise ValueError(f"{name}: seeds is on {seeds.device}: must be on the CPU or on {device}")


def _decode_seeds(name: str, seeds: object, spec: PayloadSpec, slots: int, device: torch.device) -> torch.Tensor | None:
    """The encode seeds a rotated spec needs to rotate back (None when the spec is not rotated)."""
    if not spec.rotated:
        return None
    if seeds is None:
        raise ValueError(f"{name}: spec.rotation={spec.rotation!r} needs seeds: the [slots, segments] int64 table the "
                         "payloads were encoded with (the rotation signs come from them)")  # fmt: skip
    _check_seeds(name, seeds, spec, slots, device)
    return seeds.contiguous()


def encode_payloads(
    src: torch.Tensor,
    spec: PayloadSpec,
    src_offsets: Sequence[int] | torch.Tensor,
    seeds: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Encode one chunk of ``src`` per slot into consecutive payloads of ``out``, in one call.

    Args:
        src: flat, contiguous tensor of dtype ``spec.elem_dtype``.
        spec: the payload layout.
        src_offsets: per slot, the element offset of its chunk (``spec.numel`` elements) in ``src``.
        seeds: int64 tensor ``[slots, len(spec.segments)]`` holding the unsigned 64-bit rounding
            seed of every (slot, segment) as its bit pattern (``seed - 2**64`` for seeds >= 2**63);
            on the CPU or on ``src``'s device.
        out: contiguous uint8 tensor of ``slots * spec.nbytes`` bytes, 4-byte aligned, not
            overlapping ``src``; payload ``s`` is ``out[s*nbytes:(s+1)*nbytes]``.

    Returns:
        ``out``. Segment ``i`` of slot ``s`` holds exactly ``quantize(chunk_segment, bits,
        bucket_size, rounding, seeds[s, i] mod 2**64, meta_dtype)``; padding bytes are zero.
    """
    name = "encode_payloads"
    spec = _check_spec(name, spec)
    src = _check_flat(name, "src", src, _FLOAT_DTYPES)
    if src.dtype != spec.elem_dtype:
        raise TypeError(f"{name}: src.dtype={src.dtype}: must equal spec.elem_dtype={spec.elem_dtype}")
    out = _check_flat(name, "out", out, (torch.uint8,))
    _check_seeds(name, seeds, spec, None, src.device)
    slots = seeds.shape[0]
    offsets = _offsets(name, "src_offsets", src_offsets, slots, spec.numel, src.numel())
    if out.numel() != slots * spec.nbytes:
        raise ValueError(f"{name}: out has {out.numel()} bytes: expected slots * spec.nbytes = {slots} * {spec.nbytes}")
    _check_device(name, "out", out, src.device)
    _check_aligned(name, "out", out)
    _check_disjoint(name, "src", src, "out", out)
    kernels = _backend.kernels_for(src.device)
    return kernels.encode_payloads(src, spec, offsets, seeds.contiguous(), out)


def decode_payloads(
    blob: torch.Tensor,
    spec: PayloadSpec,
    out: torch.Tensor,
    out_offsets: Sequence[int] | torch.Tensor,
    seeds: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode consecutive payloads of ``blob`` into ``out``, one chunk per slot (overwriting), in one call.

    Args:
        blob: contiguous uint8 tensor of ``slots * spec.nbytes`` bytes, 4-byte aligned.
        spec: the payload layout.
        out: flat, contiguous fp32/bf16/fp16 tensor, not overlapping ``blob``.
        out_offsets: per slot, the element offset of its chunk in ``out``; chunks must not overlap.
        seeds: the ``[slots, segments]`` int64 table the payloads were encoded with; required when
            ``spec.rotation`` is ``"hadamard"`` (the rotation signs come from it), ignored otherwise.

    Returns:
        ``out``, with ``out[out_offsets[s]:][:spec.numel]`` equal to ``dequantize`` of every
        quantized segment of payload ``s`` (and its raw segments copied), cast to ``out.dtype``.
    """
    name = "decode_payloads"
    spec = _check_spec(name, spec)
    blob = _check_flat(name, "blob", blob, (torch.uint8,))
    out = _check_flat(name, "out", out, _FLOAT_DTYPES)
    offsets = _offsets(name, "out_offsets", out_offsets, None, spec.numel, out.numel())
    slots = len(offsets)
    if blob.numel() != slots * spec.nbytes:
        raise ValueError(f"{name}: blob has {blob.numel()} bytes: expected len(out_offsets) * spec.nbytes = "
                         f"{slots} * {spec.nbytes}")  # fmt: skip
    ordered = sorted(offsets)
    for left, right in zip(ordered[:-1], ordered[1:], strict=True):
        if right - left < spec.numel:
            raise ValueError(f"{name}: out_offsets {left} and {right} overlap: chunks are {spec.numel} elements long")
    _check_device(name, "out", out, blob.device)
    _check_aligned(name, "blob", blob)
    _check_disjoint(name, "blob", blob, "out", out)
    seeds = _decode_seeds(name, seeds, spec, slots, out.device)
    kernels = _backend.kernels_for(out.device)
    return kernels.decode_payloads(blob, spec, out, offsets, seeds)


def sum_payloads(
    blob: torch.Tensor, spec: PayloadSpec, base: torch.Tensor, out: torch.Tensor, seeds: torch.Tensor | None = None
) -> torch.Tensor:
    """``out = base + decoded payload 0 + payload 1 + ...``, summed in fp32 in slot order, rounded once.

    This is the receive side of the quantized reduce-scatter: ``base`` is the rank's own exact
    chunk, the payloads come from the other ranks.

    Args:
        blob: contiguous uint8 tensor holding ``slots`` payloads (``slots * spec.nbytes`` bytes,
            any ``slots >= 0``), 4-byte aligned.
        spec: the payload layout.
        base: flat, contiguous fp32/bf16/fp16 tensor of ``spec.numel`` elements; may be ``out``
            itself, but must not partly overlap it.
        out: flat, contiguous fp32/bf16/fp16 tensor of ``spec.numel`` elements.
        seeds: the ``[slots, segments]`` int64 table of each payload's encode seeds; required when
            ``spec.rotation`` is ``"hadamard"``, ignored otherwise.

    Returns:
        ``out``: per element ``to(out.dtype)(((fp32(base) + d_0) + d_1) + ...)`` where ``d_s`` is the
        decoded value (a raw segment's element in fp32) of payload ``s``.
    """
    name = "sum_payloads"
    spec = _check_spec(name, spec)
    blob = _check_flat(name, "blob", blob, (torch.uint8,))
    base = _check_flat(name, "base", base, _FLOAT_DTYPES)
    out = _check_flat(name, "out", out, _FLOAT_DTYPES)
    for what, t in (("base", base), ("out", out)):
        if t.numel() != spec.numel:
            raise ValueError(f"{name}: {what} has {t.numel()} elements: expected spec.numel={spec.numel}")
    if spec.nbytes and blob.numel() % spec.nbytes:
        raise ValueError(f"{name}: blob has {blob.numel()} bytes: expected a multiple of spec.nbytes={spec.nbytes}")
    if not spec.nbytes and blob.numel():
        raise ValueError(f"{name}: blob has {blob.numel()} bytes but spec.nbytes is 0")
    _check_device(name, "base", base, blob.device)
    _check_device(name, "out", out, blob.device)
    _check_aligned(name, "blob", blob)
    _check_disjoint(name, "blob", blob, "out", out)
    same = base.data_ptr() == out.data_ptr() and base.dtype == out.dtype
    if not same:
        _check_disjoint(name, "base", base, "out", out)
    seeds = _decode_seeds(name, seeds, spec, blob.numel() // spec.nbytes if spec.nbytes else 0, out.device)
    kernels = _backend.kernels_for(out.device)
    return kernels.sum_payloads(blob, spec, base, out, seeds)
