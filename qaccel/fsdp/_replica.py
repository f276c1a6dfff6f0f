"""Hierarchical QSDP: the all-reduce of each gradient shard across replicas (nodes), as an FSDP2 hook.

HSDP shards a model within a node (S ranks) and replicates it across nodes (R replicas). FSDP2's
native HSDP all-reduce cannot be replaced, so hierarchical QSDP shards every unit on the 1-D
intra-node mesh and registers a :class:`ReplicaAllReduce` with ``FSDPModule.set_all_reduce_hook``:
FSDP2 calls it with the reduce-scatter output (the summed gradient shard of this node) before its
post-divide, and the hook sums it over the replica group in place (``docs/qsdp.md``,
"Hierarchical QSDP").

Quantized (``replica_grad_bits``): the shard is cut into R chunks, each parameter segment into R
equal pieces (padded with zeros), so every chunk has the same segment map and the same payload size;
a quantized reduce-scatter (all-to-all of k-bit chunks, fp32 sum) leaves chunk ``j`` summed on
replica ``j``, and a quantized all-gather hands every replica every summed chunk. Every replica,
the owner included, decodes the gathered bytes, so the replicas end bit-identical. Off: an exact
``all_reduce(SUM)``. Weights never cross nodes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist

from ..comm import (
    BufferPool,
    CollectiveTally,
    PayloadLayout,
    PhaseTimer,
    WireCodec,
    WireMeter,
    quantized_all_gather,
    quantized_reduce_scatter,
    ring_all_reduce_bytes,
)
from ._plan import UnitPlan, merge_segments, segments_numel
from ._seeds import Direction, SeedSchedule
from ._units import AllReduceHook, HookOwner

__all__ = [
    "ReplicaAllReduce",
    "QuantizedReplicaAllReduce",
    "ReplicaChunking",
    "ReplicaPiece",
    "bytes_by_level",
    "KIND_REPLICA_RS",
    "KIND_REPLICA_AG",
    "KIND_REPLICA_AR",
    "INTER_NODE_KINDS",
    "INTER_NODE_PREFIX",
    "INTER_ISLAND_PREFIX",
    "is_inter_node",
]

KIND_REPLICA_RS = "qsdp.replica_reduce_scatter"
KIND_REPLICA_AG = "qsdp.replica_all_gather"
KIND_REPLICA_AR = "hsdp.replica_all_reduce"  # exact fp32 (replica_grad_bits off, or a unit too small to quantize)
INTER_NODE_KINDS = frozenset((KIND_REPLICA_RS, KIND_REPLICA_AG, KIND_REPLICA_AR))


INTER_NODE_PREFIX = "hsdp."
"""Kinds recorded over an HSDP replica group start with it (``hsdp.replica_all_reduce``, a sharded 1-bit
optimizer's ``hsdp.onebit.*``)."""

INTER_ISLAND_PREFIX = "diloco."
"""DiLoCo's outer collectives (``diloco.outer_*``) run between islands: over the replica group of an HSDP
model, or between DDP ranks that are each an island; either way over the slow link."""


def is_inter_node(kind: str) -> bool:
    """Whether collectives of ``kind`` run over the replica group (across nodes) or between DiLoCo's islands."""
    return kind in INTER_NODE_KINDS or kind.startswith((INTER_NODE_PREFIX, INTER_ISLAND_PREFIX))


def bytes_by_level(tallies: Mapping[str, CollectiveTally]) -> dict[str, int]:
    """Bytes sent per level: ``inter_node`` (collectives over the replica group) and ``intra_node`` (the rest).

    Under hierarchical QSDP, or a sharded 1-bit optimizer, the replica group spans nodes and every
    other qaccel collective stays inside one; on a 1-D mesh everything is counted as ``intra_node``
    (the mesh is one "node" to qaccel).
    """
    levels = {"intra_node": 0, "inter_node": 0}
    for kind, tally in tallies.items():
        levels["inter_node" if is_inter_node(kind) else "intra_node"] += tally.sent_bytes
    return levels


@dataclass(frozen=True)
class ReplicaPiece:
    """Where one segment of a gradient shard goes in the replica chunks."""

    offset: int  # of the segment in the shard
    numel: int  # of the segment
    piece: int  # elements of the segment in each chunk (ceil(numel / R))
    chunk_offset: int  # of the piece in a chunk


@dataclass(frozen=True)
class ReplicaChunking:
    """How a gradient shard is cut into ``replicas`` chunks that share one segment map.

    Segment ``i`` of ``n_i`` elements contributes ``ceil(n_i / R)`` elements to every chunk (zeros
    past its end), as FSDP2 pads each parameter to a multiple of the mesh size; the pieces form the
    chunk's segment map by the same rule as :meth:`UnitPlan.build` (:func:`merge_segments`).
    """

    segments: tuple[tuple[int, bool], ...]
    replicas: int

    @cached_property
    def pieces(self) -> tuple[ReplicaPiece, ...]:
        pieces = []
        offset = chunk_offset = 0
        for numel, _ in self.segments:
            piece = math.ceil(numel / self.replicas)
            pieces.append(ReplicaPiece(offset, numel, piece, chunk_offset))
            offset += numel
            chunk_offset += piece
        return tuple(pieces)

    @cached_property
    def chunk_segments(self) -> tuple[tuple[int, bool], ...]:
        return merge_segments((p.piece, quantize) for p, (_, quantize) in zip(self.pieces, self.segments, strict=True))

    @property
    def shard_numel(self) -> int:
        return segments_numel(self.segments)

    @property
    def chunk_numel(self) -> int:
        return segments_numel(self.chunk_segments)

    def split(self, shard: torch.Tensor, chunks: torch.Tensor) -> None:
        """Write ``shard`` into ``chunks`` (``replicas x chunk_numel``, row ``j`` = chunk ``j``)."""
        for p in self.pieces:
            if not p.piece:
                continue
            full, rest = divmod(p.numel, p.piece)
            columns = chunks[:, p.chunk_offset : p.chunk_offset + p.piece]
            columns[:full].copy_(shard[p.offset : p.offset + full * p.piece].view(full, p.piece))
            if full < self.replicas:
                columns[full, :rest].copy_(shard[p.offset + full * p.piece : p.offset + p.numel])
                columns[full, rest:].zero_()
                columns[full + 1 :].zero_()

    def join(self, chunks: torch.Tensor, shard: torch.Tensor) -> None:
        """Inverse of :meth:`split`: read the segments back from ``chunks`` into ``shard``."""
        for p in self.pieces:
            if not p.piece:
                continue
            full, rest = divmod(p.numel, p.piece)
            columns = chunks[:, p.chunk_offset : p.chunk_offset + p.piece]
            shard[p.offset : p.offset + full * p.piece].view(full, p.piece).copy_(columns[:full])
            if rest:
                shard[p.offset + full * p.piece : p.offset + p.numel].copy_(columns[full, :rest])


class ReplicaAllReduce(AllReduceHook):
    """``FSDPModule.set_all_reduce_hook`` callable: sums a unit's gradient shard over the replica group in place, exactly.

    An fp32 ``all_reduce(SUM)`` (``replica_grad_bits`` off, or a unit that stays on the stock
    intra-node collectives: it is small). :class:`QuantizedReplicaAllReduce` puts k-bit codes on the
    wire instead.

    Args:
        group: the replica process group (the ranks holding this rank's shard on other nodes).
        meter: where bytes are recorded (kind ``hsdp.replica_all_reduce``).
    """

    hook_owner = HookOwner.HIERARCHICAL_QSDP

    def __init__(self, group: dist.ProcessGroup, meter: WireMeter) -> None:
        self.group = group
        self.meter = meter

    def __call__(self, reduce_output: torch.Tensor) -> None:
        nbytes = ring_all_reduce_bytes(reduce_output.numel() * reduce_output.element_size(), self.group.size())
        self.meter.record(KIND_REPLICA_AR, sent_bytes=nbytes, recv_bytes=nbytes)
        dist.all_reduce(reduce_output, op=dist.ReduceOp.SUM, group=self.group)


class QuantizedReplicaAllReduce(ReplicaAllReduce):
    """The all-reduce across replicas as a quantized reduce-scatter plus a quantized all-gather of R chunks.

    The shard is cut into R chunks with one segment map (:class:`ReplicaChunking`); chunk ``j`` is
    summed on replica ``j`` from k-bit codes, then every replica gathers and decodes every summed
    chunk, the owner included, so the replicas end bit-identical.

    Args:
        plan: the unit's gradient segment map (the reduce-scatter output has the same layout).
        codec: the quantizer across replicas (``QSDPConfig.replica_grad_codec()``).
        seeds: the model's seed schedule.
        meter: where bytes are recorded (``qsdp.replica_reduce_scatter`` / ``qsdp.replica_all_gather``).
        group: the replica process group.
        owner: this rank's index among all ranks of the model (``replica * S + shard rank``).
        buffers: the model's buffer pool for the staging blobs.
        timer: splits each collective into encode / transport / decode (None: off).
        kinds: the meter's names for the reduce-scatter and the all-gather (DiLoCo's outer all-reduce
            records its own).
        error_feedback: keep what quantization dropped and add it to the next call (off for
            hierarchical QSDP): the chunks this rank sends (``quantized_reduce_scatter``'s ``error``),
            and its summed chunk before the all-gather, whose dropped part is the compensated sum minus
            what every rank decoded. Both buffers are :attr:`errors` (fp32, per shard size and dtype).
    """

    def __init__(
        self,
        plan: UnitPlan,
        codec: WireCodec,
        seeds: SeedSchedule,
        meter: WireMeter,
        group: dist.ProcessGroup,
        owner: int,
        buffers: BufferPool | None = None,
        *,
        timer: PhaseTimer | None = None,
        kinds: tuple[str, str] = (KIND_REPLICA_RS, KIND_REPLICA_AG),
        error_feedback: bool = False,
    ) -> None:
        super().__init__(group, meter)
        self.plan = plan
        self.codec = codec
        self.seeds = seeds
        self.owner = owner
        self.buffers = BufferPool() if buffers is None else buffers
        self.timer = timer
        self.kinds = kinds
        self.error_feedback = error_feedback
        # (shard numel, dtype) -> (error of the sent chunks [(R-1) x chunk], error of the own summed chunk [chunk])
        self.errors: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self._chunking: dict[tuple[int, torch.dtype], tuple[ReplicaChunking, PayloadLayout]] = {}

    def _plan_for(self, numel: int, dtype: torch.dtype) -> tuple[ReplicaChunking, PayloadLayout]:
        key = (numel, dtype)
        if key not in self._chunking:
            segments = self.plan.segments
            if self.plan.numel != numel:
                # Same fallback as the intra-node comm (which warns once): uniform buckets.
                segments = ((numel, True),)
            chunking = ReplicaChunking(segments, self.group.size())
            layout = PayloadLayout(segments=chunking.chunk_segments, codec=self.codec, elem_dtype=dtype)
            self._chunking[key] = (chunking, layout)
        return self._chunking[key]

    def __call__(self, reduce_output: torch.Tensor) -> None:
        replicas = self.group.size()
        flat = reduce_output.view(-1)
        chunking, layout = self._plan_for(flat.numel(), flat.dtype)
        chunks = torch.empty(replicas, chunking.chunk_numel, dtype=flat.dtype, device=flat.device)
        chunking.split(flat, chunks)
        unit, call = self.plan.index, self.seeds.next_replica_call(self.plan.index)
        rs_seeds = [self.seeds.replica_seed(unit, self.owner, Direction.REPLICA_GRAD, dest, call) for dest in range(replicas)]
        own = torch.empty(chunking.chunk_numel, dtype=flat.dtype, device=flat.device)
        sent_error, own_error = self._errors_for(flat.numel(), flat.dtype, chunking.chunk_numel, flat.device)
        quantized_reduce_scatter(own, chunks, self.group, layout, rs_seeds, self.meter, self.kinds[0], error=sent_error, buffers=self.buffers, timer=self.timer)
        if own_error is not None:
            own.add_(own_error)
        ag_seed = self.seeds.replica_seed(unit, self.owner, Direction.REPLICA_GATHER, 0, call)
        quantized_all_gather(chunks.view(-1), own, self.group, layout, ag_seed, self.meter, self.kinds[1], buffers=self.buffers, timer=self.timer)
        if own_error is not None:  # what the all-gather dropped: every rank, the owner too, decoded chunks[rank]
            own_error.copy_(own.float() - chunks[self.group.rank()].float())
        chunking.join(chunks, flat)

    def load_errors(self, numel: int, dtype: torch.dtype, sent: torch.Tensor, own: torch.Tensor) -> None:
        """Restore the error buffers of shards of ``numel`` values of ``dtype`` (from :attr:`errors` of a saved run).

        Raises:
            ValueError: ``sent`` is not ``(R-1) x`` the size of ``own`` for this group's R replicas.
        """
        expected = (self.group.size() - 1) * own.numel()
        if sent.numel() != expected:
            raise ValueError(f"error feedback of {sent.numel()} values, expected {expected} for {self.group.size()} replicas")
        self.errors[(numel, dtype)] = (sent.clone(), own.clone())

    def _errors_for(self, numel: int, dtype: torch.dtype, chunk_numel: int, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not self.error_feedback:
            return None, None
        key = (numel, dtype)
        if key not in self.errors:
            replicas = self.group.size()
            self.errors[key] = (torch.zeros((replicas - 1) * chunk_numel, device=device), torch.zeros(chunk_numel, device=device))
        return self.errors[key]
