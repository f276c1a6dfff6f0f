"""The odd-sized tiny GPT-2 of the QSDP tests, sharded the way Accelerate does, its data and the codec's byte oracle.

Its sizes are odd on purpose (width 65, vocabulary 509, 35 positions): dim 0 of most parameters does not divide by
2, 3 or 4, so FSDP2 pads the shards and the last rank holds fewer rows.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from qaccel.quant import quantize

__all__ = [
    "MAX_ALIGNMENT_PADDING", "PARAM_MIN_NUMEL", "TINY", "VOCAB", "batch", "build_gpt2", "codec_chunk_bytes",
    "hsdp_meshes", "is_quantized", "padded_rows", "shard_like_accelerate", "train_step",
]  # fmt: skip

# Odd sizes (see the module docstring); dropout off: compared runs must see identical computations.
TINY = {
    "n_layer": 2, "n_embd": 65, "n_head": 5, "vocab_size": 509, "n_positions": 35,
    "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 508, "eos_token_id": 508,
}  # fmt: skip
VOCAB = TINY["vocab_size"]
PARAM_MIN_NUMEL = 1024  # QSDPConfig's default: 2-D parameters with at least this many elements are quantized
MAX_ALIGNMENT_PADDING = 6


def build_gpt2(seed: int = 0, **overrides):
    """The tiny GPT-2 (TINY, with ``overrides``), initialised from ``seed``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**{**TINY, **overrides}))


def shard_like_accelerate(model, world_size: int, mesh=None):
    """One FSDP2 unit per block, then the root, as Accelerate's transformer-based wrap does."""
    mesh = mesh if mesh is not None else init_device_mesh("cpu", (world_size,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def hsdp_meshes(replicas: int = 2, shards: int = 2):
    """The 2-D ``("replicate", "shard")`` mesh, its intra-node ``shard`` mesh and the replica group of this rank."""
    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    return mesh, mesh["shard"], mesh["replicate"].get_group()


def batch(rank: int, step: int, vocab: int = VOCAB, size: tuple[int, int] = (4, 16)) -> torch.Tensor:
    """Rank ``rank``'s token batch at ``step``."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, size, generator=gen)


def train_step(model, optimizer, tokens: torch.Tensor) -> torch.Tensor:
    """One language-modelling step; the loss."""
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def is_quantized(shape) -> bool:
    """Whether QSDPConfig's defaults quantize a parameter of ``shape`` (2-D with at least PARAM_MIN_NUMEL elements)."""
    return len(shape) >= 2 and math.prod(shape) >= PARAM_MIN_NUMEL


def padded_rows(shape, world: int) -> int:
    """Rows of each rank's shard under FSDP2's dim-0 sharding (dim 0 padded to a multiple of the world)."""
    return math.ceil(shape[0] / world)


def codec_chunk_bytes(shapes, world, codec, elem_size):
    """Bytes of one rank-chunk by the codec: each parameter's padded shard quantized on its own.

    The segment map of the design (docs/qsdp.md): buckets restart at every parameter; 1-D and small
    parameters travel raw. The codec's ``quantize(...).nbytes`` gives each quantized shard's size.
    """
    total = 0
    for shape in shapes:
        numel = padded_rows(shape, world) * math.prod(shape[1:])
        if is_quantized(shape):
            total += quantize(torch.zeros(numel), codec.bits, codec.bucket_size, "nearest", 0, codec.meta_dtype).nbytes
        else:
            total += numel * elem_size
    return total
