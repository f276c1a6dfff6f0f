"""Fused 1-bit error feedback: one side of the 1-bit all-reduce per call (``qaccel.comm._onebit``).

Each call is one ``torch.ops.qaccel.onebit_*`` op on the backend ``QACCEL_KERNELS`` selects for the
tensors' device, bit-identical on every backend to the unfused ``sign_compress`` /
``sign_decompress`` sequence it replaces (:func:`qaccel.quant.reference.onebit_encode` and
:func:`~qaccel.quant.reference.onebit_server` are that sequence, and the specification).
"""

from __future__ import annotations

import torch

from . import _backend

__all__ = ["onebit_encode", "onebit_server"]


def _check_error(where: str, error: object, chunks: int) -> None:
    if not isinstance(error, torch.Tensor) or error.dtype != torch.float32 or error.dim() != 1:
        raise ValueError(f"{where}: error must be a 1-D float32 tensor")
    if not error.is_contiguous() or error.numel() == 0:
        raise ValueError(f"{where}: error must be contiguous and non-empty, got {error.numel()} elements")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1 or error.numel() % chunks:
        raise ValueError(f"{where}: chunks={chunks!r}: must be an int >= 1 dividing error.numel()={error.numel()}")


def onebit_encode(x: torch.Tensor, error: torch.Tensor, chunks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker side: compress ``pad(x) + error`` and keep the new compression error in ``error``.

    Args:
        x: the local values (any float dtype and shape, at most ``error.numel()`` elements; read as
            fp32 and zero-padded to ``error.numel()``).
        error: flat fp32 error buffer, updated in place.
        chunks: equal chunks of ``error.numel()``, each with its own scale.

    Returns:
        ``(signs, scales)``: the packed sign bits (``x >= 0``, MSB first, each chunk whole bytes) and
        one fp32 ``||c|| / sqrt(n_c)`` per chunk, as ``sign_compress`` of the compensated values.
    """
    _check_error("onebit_encode", error, chunks)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError("onebit_encode: x must be a floating-point tensor")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.to(torch.float32)  # e.g. fp64: rounded to fp32 once, as the padded copy always did
    if x.numel() > error.numel() or x.device != error.device:
        raise ValueError(
            f"onebit_encode: x ({x.numel()} elements on {x.device}) must fit error "
            f"({error.numel()} elements on {error.device})"
        )
    return _backend.kernels_for(error.device).onebit_encode(x.detach(), error, chunks)


def onebit_server(
    signs: torch.Tensor, scales: torch.Tensor, error: torch.Tensor, chunks: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Server side: average the workers' compressed chunks, add ``error``, compress the result again.

    Args:
        signs: ``N`` rows of ``ceil(n/8)`` sign bytes (uint8, any shape), one per worker, for this
            rank's chunk of ``n = error.numel()`` elements.
        scales: the ``N`` workers' fp32 scales; each is multiplied by ``1/N`` before decoding.
        error: flat fp32 server error buffer, updated in place.
        chunks: as for :func:`onebit_encode`.

    Returns:
        ``(signs, scales)`` of the compensated average, as :func:`onebit_encode` returns them.
    """
    _check_error("onebit_server", error, chunks)
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or scales.dim() != 1 or scales.numel() == 0:
        raise ValueError("onebit_server: scales must be a non-empty 1-D float32 tensor (one per worker)")
    row_bytes = (error.numel() + 7) // 8
    if not isinstance(signs, torch.Tensor) or signs.dtype != torch.uint8 or signs.numel() != scales.numel() * row_bytes:
        raise ValueError(f"onebit_server: signs must be a uint8 tensor of {scales.numel()} rows of {row_bytes} bytes")
    return _backend.kernels_for(error.device).onebit_server(signs, scales.contiguous(), error, chunks)
