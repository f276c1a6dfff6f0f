"""The segment map of a unit's flat FSDP2 buffers: one padding rule and one merge rule, used by every path.

FSDP2 lays a unit's parameters out in one flat buffer, each padded to a whole number of dim-0 rows
per rank (:func:`padded_shard_numel`); QSDP cuts a rank's chunk of it into segments, quantized or
raw, adjacent raw ones merged (:func:`merge_segments`). The intra-node comms (:class:`UnitPlan`),
the overlapped reduce-scatter's replay of FSDP2's tail and hierarchical QSDP's replica chunks all
call these, so they cannot disagree about where a parameter sits.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ..comm import PayloadLayout, WireCodec

__all__ = ["UnitPlan", "merge_segments", "padded_shard_numel", "segments_numel"]

logger = logging.getLogger(__name__)


def padded_shard_numel(shape: torch.Size, world_size: int) -> int:
    """Elements of one rank's padded dim-0 shard of a parameter of ``shape`` (FSDP2's per-parameter stride)."""
    if len(shape) == 0:
        return 1
    return math.ceil(shape[0] / world_size) * math.prod(shape[1:])


def merge_segments(segments: Iterable[tuple[int, bool]]) -> tuple[tuple[int, bool], ...]:
    """``(numel, quantize)`` pairs as a segment map: empty ones dropped, adjacent raw ones merged into one.

    Raw segments travel in the element dtype whatever their boundaries, so merging them saves
    nothing on the wire but segment bookkeeping; quantized ones keep their own buckets.
    """
    merged: list[tuple[int, bool]] = []
    for numel, quantize in segments:
        if numel == 0:
            continue
        if merged and not quantize and not merged[-1][1]:
            merged[-1] = (merged[-1][0] + numel, False)
        else:
            merged.append((numel, quantize))
    return tuple(merged)


@dataclass(frozen=True)
class UnitPlan:
    """What one unit sends: its segment map and whether it is quantized at all.

    Attributes:
        index: unit index (part of every seed).
        name: for messages.
        segments: ``(padded_shard_numel, quantize)`` per parameter, in buffer order.
        enabled: False when the unit stays on the stock collectives (``unit_min_numel``, or no
            parameter worth quantizing).
    """

    index: int
    name: str
    segments: tuple[tuple[int, bool], ...]
    enabled: bool
    _layouts: dict[tuple, PayloadLayout] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def build(cls, index: int, name: str, shapes: Sequence[torch.Size], shard_numels: Sequence[int], *, param_min_numel: int, unit_min_numel: int) -> UnitPlan:
        """Segment map: 1-D or small parameters raw, others quantized; adjacent raw ones merged."""
        segments = merge_segments(
            (numel, len(shape) >= 2 and shape.numel() >= max(param_min_numel, 1)) for shape, numel in zip(shapes, shard_numels, strict=True)
        )
        enabled = segments_numel(segments) >= unit_min_numel and any(q for _, q in segments)
        return cls(index=index, name=name, segments=segments, enabled=enabled)

    @property
    def numel(self) -> int:
        """Elements of one rank's chunk (the reduce-scatter output, the all-gather input)."""
        return segments_numel(self.segments)

    def layout(self, codec: WireCodec, chunk_numel: int, elem_dtype: torch.dtype) -> PayloadLayout:
        """The payload layout for a chunk of ``chunk_numel`` elements, cached per (length, dtype)."""
        key = (codec, chunk_numel, elem_dtype)
        layout = self._layouts.get(key)
        if layout is None:
            segments = self.segments
            if self.numel != chunk_numel:
                # The buffer does not match our reading of FSDP's layout (e.g. a torch change):
                # stay correct with uniform buckets over the whole chunk, and say so once.
                logger.warning(
                    "QSDP unit %d (%s): segment map sums to %d elements but the FSDP buffer chunk has %d; "
                    "falling back to uniform buckets over the whole chunk",
                    self.index, self.name, self.numel, chunk_numel,
                )  # fmt: skip
                segments = ((chunk_numel, True),)
            layout = PayloadLayout(segments=segments, codec=codec, elem_dtype=elem_dtype)
            self._layouts[key] = layout
        return layout


def segments_numel(segments: Sequence[tuple[int, bool]]) -> int:
    """Elements a segment map covers."""
    return sum(n for n, _ in segments)
