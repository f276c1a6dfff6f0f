"""The 1-bit codec's own time in ``qaccel bench quant``: fused error-feedback ops against the unfused sequence.

Per backend, on the throughput study's tensor of ``n`` fp32 values, it times one side of the 1-bit
all-reduce each (``qaccel.comm._onebit``): the worker side (compensate, scale, sign, pack, new error)
over all ``n`` values, and the server side of one rank among :data:`WORLD` (decode the ``WORLD``
workers' chunks of ``n / WORLD`` values, average, compensate, recompress, new error). Each is timed
as the fused op (``onebit_encode`` / ``onebit_server``) and as the sequence of codec calls and torch
arithmetic the all-reduce ran before the ops were fused (the same backend's ``sign_pack`` /
``sign_unpack`` and the reference's ``chunk_rms``). Figures are nanoseconds per value of the tensor
(``n``), so worker plus server is the codec's cost per gradient value and step on one rank.
"""

from __future__ import annotations

import torch

WORLD = 4  # ranks of the simulated server side (each server owns n / WORLD values)


def _unfused_compress(kernels, values: torch.Tensor, error: torch.Tensor) -> None:
    signs = kernels.sign_pack(values, 1)
    scales = kernels.chunk_rms(values, 1)
    error.copy_(values - kernels.sign_unpack(signs, scales, values.numel(), torch.empty_like(values)))


def _unfused_encode(kernels, x: torch.Tensor, error: torch.Tensor) -> None:
    compensated = torch.zeros(error.numel(), dtype=torch.float32, device=error.device)
    compensated[: x.numel()] = x.reshape(-1)
    compensated.add_(error)
    _unfused_compress(kernels, compensated, error)


def _unfused_server(kernels, signs: torch.Tensor, scales: torch.Tensor, error: torch.Tensor) -> None:
    world, numel = scales.numel(), error.numel()
    decoded = torch.empty(world * numel, dtype=torch.float32, device=error.device)
    kernels.sign_unpack(signs, scales * (1 / world), world * numel, decoded)
    averaged = decoded.view(world, numel).sum(0)
    averaged.add_(error)
    _unfused_compress(kernels, averaged, error)


def measure(kernels, x: torch.Tensor, repeats: int, median_seconds) -> dict:
    """ns per value of ``x`` for each side, fused and unfused, on ``kernels``' backend.

    ``median_seconds(fn, device, repeats)`` is the study's timer (warm-up, then the median).
    """
    numel = x.numel() - x.numel() % (8 * WORLD)  # whole sign bytes per server chunk, as onebit_layout pads
    x = x[:numel]
    error = torch.zeros(numel, dtype=torch.float32, device=x.device)
    chunk = numel // WORLD
    gen = torch.Generator().manual_seed(1)
    signs = torch.randint(0, 256, (WORLD * chunk // 8,), dtype=torch.uint8, generator=gen).to(x.device)
    scales = torch.rand(WORLD, generator=gen).to(x.device)
    server_error = torch.zeros(chunk, dtype=torch.float32, device=x.device)
    seconds = {
        "encode_fused": median_seconds(lambda: kernels.onebit_encode(x, error, 1), x.device, repeats),
        "encode_unfused": median_seconds(lambda: _unfused_encode(kernels, x, error), x.device, repeats),
        "server_fused": median_seconds(
            lambda: kernels.onebit_server(signs, scales, server_error, 1), x.device, repeats
        ),
        "server_unfused": median_seconds(
            lambda: _unfused_server(kernels, signs, scales, server_error), x.device, repeats
        ),
    }
    row: dict = {"numel": numel, "world": WORLD}
    row.update({f"{name}_ns_per_value": s / numel * 1e9 for name, s in seconds.items()})
    for side in ("encode", "server"):
        row[f"{side}_speedup"] = seconds[f"{side}_unfused"] / seconds[f"{side}_fused"]
    return row
