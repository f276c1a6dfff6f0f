"""Master-weight mode ``quantized``: keep each stored shard on its quantization grid.

``docs/qsdp.md``, "Master weights", mode ``quantized``: after every optimizer step each rank replaces its
shard of every quantized unit by a fresh stochastic rounding of it, ``x <- Q(x)``, the iteration
``x_{t+1} = Q_w(x_t - lr * g)`` the paper's theorem analyses. The rounding buckets over exactly
the flat padded layout the all-gather sees (same segments, same zero padding), so the next
all-gather re-quantizes a value already on the grid; bucket minima and maxima decode to
themselves, so the grid survives. With ``param_dtype=bf16`` the all-gather sees a bf16 cast of
the stored value and re-rounding is no longer exact (still unbiased).
"""

from __future__ import annotations

import torch

from ..comm import WireCodec, decode_chunk, encode_chunk
from ._plan import UnitPlan
from ._units import FSDPUnit

__all__ = ["requantize_shards"]


@torch.no_grad()
def requantize_shards(unit: FSDPUnit, plan: UnitPlan, codec: WireCodec, seed: int) -> None:
    """Replace this rank's local shards of ``unit`` by their quantized values, in place."""
    locals_ = [param.to_local() for param in unit.params]
    shard_numels = unit.shard_numels()
    device = locals_[0].device if locals_ else torch.device("cpu")
    # (sum of padded shard numels,): the all-gather input layout, padding zero as in FSDP.
    flat = torch.zeros(sum(shard_numels), dtype=torch.float32, device=device)
    offset = 0
    for local, numel in zip(locals_, shard_numels, strict=True):
        flat[offset : offset + local.numel()].copy_(local.reshape(-1))
        offset += numel
    layout = plan.layout(codec, flat.numel(), flat.dtype)
    blob = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    decode_chunk(encode_chunk(flat, layout, seed, blob), layout, flat)
    offset = 0
    for local, numel in zip(locals_, shard_numels, strict=True):
        local.copy_(flat[offset : offset + local.numel()].view_as(local))
        offset += numel
