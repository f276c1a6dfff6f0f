"""Collectives built on the codecs, and exact wire-byte accounting."""

from ._accounting import CollectiveTally, WireMeter, default_meter, ring_all_gather_bytes, ring_all_reduce_bytes
from ._buffers import BufferPool
from ._ddp_hooks import metered_allreduce_hook
from ._onebit import (
    ONEBIT_PADDINGS,
    OneBitLayout,
    OneBitWireBytes,
    PendingCompressedAllReduce,
    compressed_allreduce,
    onebit_layout,
    onebit_wire_bytes,
    start_compressed_allreduce,
)
from ._payload import PayloadLayout, SegmentOffsets, WireCodec, decode_chunk, encode_chunk, mix_seed, seed_table
from ._phases import PHASES, PhaseTimer, PhaseTotals
from ._quantized import quantized_all_gather, quantized_reduce_scatter
from ._stock import alltoall_reduce_scatter, counted_all_gather, counted_reduce_scatter
from ._work import DecodeOnWait

__all__ = [
    "BufferPool",
    "DecodeOnWait",
    "PHASES",
    "PhaseTimer",
    "PhaseTotals",
    "CollectiveTally",
    "WireMeter",
    "default_meter",
    "ring_all_gather_bytes",
    "PayloadLayout",
    "SegmentOffsets",
    "WireCodec",
    "seed_table",
    "counted_all_gather",
    "counted_reduce_scatter",
    "alltoall_reduce_scatter",
    "decode_chunk",
    "encode_chunk",
    "mix_seed",
    "quantized_all_gather",
    "quantized_reduce_scatter",
    "ONEBIT_PADDINGS",
    "OneBitLayout",
    "OneBitWireBytes",
    "compressed_allreduce",
    "start_compressed_allreduce",
    "PendingCompressedAllReduce",
    "onebit_layout",
    "onebit_wire_bytes",
    "ring_all_reduce_bytes",
    "metered_allreduce_hook",
]
