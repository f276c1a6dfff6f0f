"""Bytes per link in one training step of every sharding method, for ``qaccel bench project``.

The bytes come from the formulas qaccel's wire meter records (never estimated): the payload layouts of
:mod:`qaccel.comm` (``PayloadLayout.nbytes``, ``ring_all_gather_bytes``, ``ring_all_reduce_bytes``), the
segment maps of :class:`qaccel.fsdp.UnitPlan` and the replica chunking of hierarchical QSDP, applied to the
parameter shapes of each FSDP2 unit (one unit per transformer block, then the root, as Accelerate wraps).

Where those bytes travel follows the algorithm of each collective, for ranks placed node by node
(global rank = node * ranks_per_node + local rank, as torchrun and Accelerate number them):

* ring all-gather and ring all-reduce (gloo and NCCL): each rank sends its bytes to its ring successor
  (group rank + 1), so a flat ring over ``N`` nodes crosses a node boundary on ``N`` of its edges: every
  node's link to the others carries exactly one rank's bytes in each direction;
* all-to-all (qaccel's quantized reduce-scatter): each rank sends one chunk straight to every other
  member, so a node sends ``g * (P - g)`` chunks across nodes;
* stock reduce-scatter: NCCL runs a ring reduce-scatter; gloo runs an all-reduce of the whole input and
  keeps a chunk (pytorch/pytorch#118911), twice the ring reduce-scatter's bytes;
* groups inside one node never touch the inter-node link; replica groups (one rank per node) only do.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields

import torch

from ..comm import PayloadLayout, WireCodec, ring_all_gather_bytes, ring_all_reduce_bytes
from ..fsdp import QSDPConfig, ReplicaChunking, UnitPlan, padded_shard_numel

__all__ = [
    "Unit",
    "ModelShapes",
    "Method",
    "METHODS",
    "Traffic",
    "Collective",
    "model_shapes",
    "group_traffic",
    "step_collectives",
    "policy_dtypes",
    "ALGORITHMS",
    "GROUPS",
]

ALGORITHMS = ("ring_all_gather", "ring_all_reduce", "all_to_all")
GROUPS = ("flat", "node", "replica")
_ITEMSIZE = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


@dataclass(frozen=True)
class Unit:
    """One FSDP2 unit: the shapes of its parameters in buffer order; the root is gathered once per forward only."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    root: bool = False

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)


@dataclass(frozen=True)
class ModelShapes:
    """The units of a model (root first, as FSDP2 gathers it first in forward and reduces it last in backward)."""

    name: str
    units: tuple[Unit, ...]

    @property
    def num_params(self) -> int:
        return sum(unit.numel for unit in self.units)


def model_shapes(model: torch.nn.Module, layer_cls: str, name: str) -> ModelShapes:
    """Units as Accelerate's transformer-based wrap makes them: every ``layer_cls`` module, then the root.

    Works on a meta-device model (no memory). Tied parameters count once, in the first unit holding them.
    """
    seen: set[int] = set()
    blocks: list[Unit] = []

    def take(module: torch.nn.Module) -> tuple[tuple[int, ...], ...]:
        shapes = []
        for param in module.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                shapes.append(tuple(param.shape))
        return tuple(shapes)

    for qualified, module in model.named_modules():
        if type(module).__name__ == layer_cls and module is not model:
            blocks.append(Unit(qualified, take(module)))
    if not blocks:
        raise ValueError(f"model {name!r}: no module of class {layer_cls!r} to wrap as an FSDP2 unit")
    root = Unit("root", take(model), root=True)
    return ModelShapes(name, (root, *blocks))


# -- methods ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Method:
    """A sharding method as the simulated cluster and a real one run it.

    Attributes:
        name: the key ``qaccel bench e2e`` uses for it.
        title: for tables.
        hierarchical: shard within a node, replicate across nodes (HSDP); else shard over all ranks.
        weight_bits / grad_bits: QSDP bits of the (intra-node, when hierarchical) all-gather and
            reduce-scatter; ``None``: the stock collective.
        replica_grad_bits: hierarchical QSDP's bits across replicas; ``None``: an exact all-reduce.
        qaccel: qaccel's comms are installed (QSDP or hierarchical QSDP); False: stock FSDP2 / HSDP.
    """

    name: str
    title: str
    hierarchical: bool = False
    weight_bits: int | None = None
    grad_bits: int | None = None
    replica_grad_bits: int | None = None
    qaccel: bool = False

    def config(self) -> QSDPConfig:
        """The QSDP settings of the method (codecs with their per-bit bucket defaults)."""
        return QSDPConfig(
            weight_bits=self.weight_bits, grad_bits=self.grad_bits, replica_grad_bits=self.replica_grad_bits
        )


_TABLE = (
    Method("fsdp2", "stock FSDP2"),
    Method("hsdp", "stock HSDP", hierarchical=True),
    Method("qsdp-off", "qaccel comms, compression off", qaccel=True),
    Method("qsdp-w8g8", "QSDP W8G8", weight_bits=8, grad_bits=8, qaccel=True),
    Method("qsdp-w4g4", "QSDP W4G4", weight_bits=4, grad_bits=4, qaccel=True),
    Method("hqsdp-w8g8-r8", "hierarchical QSDP W8G8, 8-bit across nodes", True, 8, 8, 8, qaccel=True),
    Method("hqsdp-w8g8-r4", "hierarchical QSDP W8G8, 4-bit across nodes", True, 8, 8, 4, qaccel=True),
    Method(
        "hqsdp-off-r4", "hierarchical QSDP, intra-node codecs off, 4-bit across nodes", True, None, None, 4, qaccel=True
    ),
)
METHODS: dict[str, Method] = {m.name: m for m in _TABLE}


def policy_dtypes(method: Method, compute: torch.dtype, *, accelerate: bool) -> tuple[torch.dtype, torch.dtype]:
    """``(param_dtype, reduce_dtype)`` of FSDP2's mixed-precision policy for ``method`` at ``compute`` precision.

    ``accelerate=True``: what ``Accelerator(mixed_precision=...)`` sets (reduce in the compute dtype),
    except that qaccel's QSDP plugin reduces in fp32 when gradients are quantized (``docs/qsdp.md``, "Mixed
    precision"). ``accelerate=False``: what ``qaccel bench e2e`` sets, both in the compute dtype.
    """
    if accelerate and method.qaccel and method.grad_bits is not None and compute != torch.float32:
        return compute, torch.float32
    return compute, compute


# -- where bytes go --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Traffic:
    """Bytes one collective puts on each kind of link, per step, for ranks placed node by node.

    Attributes:
        sent_per_rank: bytes every member sends (the wire meter's figure).
        intra_bus: bytes between ranks of one node, summed over the node (a medium they all share).
        intra_port: the most bytes one rank sends to ranks of its own node (a switched per-GPU port).
        inter_nic: bytes one node sends to other nodes (its link to them, one direction).
        machine: bytes all ranks of the job send (the host's transport work when all run on one machine).
        machine_inter: the part of ``machine`` that crosses nodes (every node's ``inter_nic``, summed).
    """

    sent_per_rank: float = 0.0
    intra_bus: float = 0.0
    intra_port: float = 0.0
    inter_nic: float = 0.0
    machine: float = 0.0
    machine_inter: float = 0.0


def group_traffic(group: str, algorithm: str, sent_per_rank: float, nodes: int, per_node: int) -> Traffic:
    """Where one collective's bytes go (module docstring), in closed form.

    Args:
        group: ``"flat"`` (all ``nodes * per_node`` ranks), ``"node"`` (the ``per_node`` ranks of each node,
            every node at once) or ``"replica"`` (one rank per node; ``per_node`` such groups at once).
        algorithm: one of :data:`ALGORITHMS`.
        sent_per_rank: bytes each member sends in this collective.
    """
    if group not in GROUPS or algorithm not in ALGORITHMS:
        raise ValueError(
            f"group_traffic: group={group!r} (allowed: {', '.join(GROUPS)}), algorithm={algorithm!r} (allowed: {', '.join(ALGORITHMS)})"
        )
    if nodes < 1 or per_node < 1:
        raise ValueError(f"group_traffic: nodes={nodes} and per_node={per_node} must be >= 1")
    b, g, total = float(sent_per_rank), per_node, nodes * per_node
    machine = total * b
    if group == "node" or (group == "flat" and nodes == 1):
        return Traffic(b, g * b, b, 0.0, machine, 0.0)
    if group == "replica":
        return Traffic(b, 0.0, 0.0, g * b, machine, machine)
    if algorithm == "all_to_all":  # flat over several nodes: one chunk to each of the other P - 1 ranks
        chunk = b / (total - 1)
        inter = g * (total - g) * chunk
        return Traffic(b, g * (g - 1) * chunk, (g - 1) * chunk, inter, machine, nodes * inter)
    # flat ring over several nodes: one edge out of every node crosses, the node's other g - 1 edges stay
    return Traffic(b, (g - 1) * b, b if g > 1 else 0.0, b, machine, nodes * b)


# -- the collectives of one step ---------------------------------------------------------------------
@dataclass(frozen=True)
class Collective:
    """One collective of one unit.

    Attributes:
        unit: the unit's name; ``root``: the unit on the step's edges (first gathered, last reduced).
        phase: ``all_gather`` (forward and backward), ``reduce_scatter`` or ``replica_all_reduce``.
        count: how often it runs per optimizer step.
        traffic: bytes per run (:class:`Traffic`).
        steps: sequential message steps of the algorithm (ring: ``P - 1`` per pass; all-to-all: ``P - 1``),
            each paying the link's latency when the collective crosses nodes.
        encode / decode: elements this rank quantizes / dequantizes per run, by code width.
    """

    unit: str
    root: bool
    phase: str
    count: int
    traffic: Traffic
    steps: int = 0
    encode: dict[int, float] = field(default_factory=dict)
    decode: dict[int, float] = field(default_factory=dict)


def _shard_plan(unit: Unit, shard_size: int, config: QSDPConfig) -> UnitPlan:
    shapes = [torch.Size(s) for s in unit.shapes]
    numels = [padded_shard_numel(s, shard_size) for s in shapes]
    return UnitPlan.build(
        0, unit.name, shapes, numels, param_min_numel=config.param_min_numel, unit_min_numel=config.unit_min_numel
    )


def _itemsize(dtype: torch.dtype) -> int:
    return _ITEMSIZE[dtype]


def step_collectives(
    model: ModelShapes,
    method: Method,
    *,
    nodes: int,
    per_node: int,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    backend: str,
    micro_batches: int = 1,
) -> list[Collective]:
    """Every collective of one optimizer step of ``model`` under ``method``.

    FSDP2 all-gathers every unit in forward and every unit but the root again in backward (the root is
    not resharded after forward), once per micro-batch; with gradient accumulation Accelerate turns
    gradient sync off on all but the last micro-batch (``set_requires_gradient_sync(False)``), so the
    reduce-scatter and the replica all-reduce run once per optimizer step.

    Args:
        nodes / per_node: the cluster; flat methods shard over all ``nodes * per_node`` ranks,
            hierarchical ones over the ``per_node`` ranks of a node with ``nodes`` replicas.
        param_dtype / reduce_dtype: FSDP2's mixed-precision policy (:func:`policy_dtypes`).
        backend: ``"gloo"`` (stock reduce-scatter is an all-reduce) or ``"nccl"`` (ring reduce-scatter).
        micro_batches: gradient-accumulation steps per optimizer step.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"step_collectives: backend={backend!r}; allowed: gloo, nccl")
    if method.hierarchical and nodes < 2:
        raise ValueError(f"step_collectives: {method.name} replicates across nodes; nodes={nodes} must be >= 2")
    config = method.config()
    shards = _ShardGroup(per_node if method.hierarchical else nodes * per_node,
                         "node" if method.hierarchical else "flat", nodes, per_node)  # fmt: skip
    out: list[Collective] = []
    for unit in model.units:
        plan = _shard_plan(unit, shards.size, config)
        out.append(_all_gather(unit, plan, config, shards, param_dtype, micro_batches))
        out.append(_reduce_scatter(unit, plan, config, shards, reduce_dtype, backend))
        if method.hierarchical:
            out.extend(_replica_all_reduce(unit, plan, method, config, nodes, per_node, reduce_dtype))
    return out


@dataclass(frozen=True)
class _ShardGroup:
    """The group a unit is sharded over: ``size`` ranks, laid out as ``group`` (:func:`group_traffic`) on the cluster."""

    size: int
    group: str
    nodes: int
    per_node: int

    def traffic(self, algorithm: str, sent_per_rank: float) -> Traffic:
        return group_traffic(self.group, algorithm, sent_per_rank, self.nodes, self.per_node)


def _all_gather(unit: Unit, plan: UnitPlan, config: QSDPConfig, shards: _ShardGroup, param_dtype: torch.dtype,
                micro_batches: int) -> Collective:  # fmt: skip
    """The all-gather of the unit's parameters in ``param_dtype``: forward, and backward too except for the root."""
    chunk_numel = sum(n for n, _ in plan.segments)
    ag_count = micro_batches * (1 if unit.root else 2)
    codec = config.weight_codec() if plan.enabled else None
    if codec is None:
        sent = ring_all_gather_bytes(chunk_numel * _itemsize(param_dtype), shards.size)
        return Collective(unit.name, unit.root, "all_gather", ag_count, shards.traffic("ring_all_gather", sent), shards.size - 1)
    layout = PayloadLayout(segments=plan.segments, codec=codec, elem_dtype=param_dtype)
    sent = ring_all_gather_bytes(layout.nbytes, shards.size)
    return Collective(unit.name, unit.root, "all_gather", ag_count, shards.traffic("ring_all_gather", sent), shards.size - 1,
                      encode={codec.bits: chunk_numel}, decode={codec.bits: shards.size * chunk_numel})  # fmt: skip


def _reduce_scatter(unit: Unit, plan: UnitPlan, config: QSDPConfig, shards: _ShardGroup, reduce_dtype: torch.dtype,
                    backend: str) -> Collective:  # fmt: skip
    """The reduce-scatter of the unit's gradients in ``reduce_dtype``: stock (by backend) or QSDP's quantized all-to-all."""
    chunk_numel = sum(n for n, _ in plan.segments)
    codec = config.grad_codec() if plan.enabled else None
    if codec is not None:
        layout = PayloadLayout(segments=plan.segments, codec=codec, elem_dtype=reduce_dtype)
        others = (shards.size - 1) * chunk_numel
        return Collective(unit.name, unit.root, "reduce_scatter", 1, shards.traffic("all_to_all", (shards.size - 1) * layout.nbytes),
                          shards.size - 1, encode={codec.bits: others}, decode={codec.bits: others})  # fmt: skip
    chunk_bytes = chunk_numel * _itemsize(reduce_dtype)
    if backend == "gloo":  # gloo's reduce-scatter all-reduces the whole buffer
        sent, algorithm, steps = ring_all_reduce_bytes(shards.size * chunk_bytes, shards.size), "ring_all_reduce", 2 * (shards.size - 1)
    else:  # ring reduce-scatter: P-1 chunks, the same bytes and steps as a ring all-gather
        sent, algorithm, steps = ring_all_gather_bytes(chunk_bytes, shards.size), "ring_all_gather", shards.size - 1
    return Collective(unit.name, unit.root, "reduce_scatter", 1, shards.traffic(algorithm, sent), steps)

def _replica_all_reduce(
    unit: Unit, plan: UnitPlan, method: Method, config: QSDPConfig, nodes: int, per_node: int, reduce_dtype: torch.dtype
) -> Iterable[Collective]:
    """Hierarchical QSDP's replica all-reduce (``qaccel.fsdp._replica``), or stock HSDP's exact one."""
    codec: WireCodec | None = config.replica_grad_codec() if (method.qaccel and plan.enabled) else None
    shard_numel = sum(n for n, _ in plan.segments)
    if codec is None:
        sent = ring_all_reduce_bytes(shard_numel * _itemsize(reduce_dtype), nodes)
        yield Collective(
            unit.name,
            unit.root,
            "replica_all_reduce",
            1,
            group_traffic("replica", "ring_all_reduce", sent, nodes, per_node),
            2 * (nodes - 1),
        )
        return
    chunking = ReplicaChunking(plan.segments, nodes)
    layout = PayloadLayout(segments=chunking.chunk_segments, codec=codec, elem_dtype=reduce_dtype)
    chunk = chunking.chunk_numel
    rs = group_traffic("replica", "all_to_all", (nodes - 1) * layout.nbytes, nodes, per_node)
    ag = group_traffic("replica", "ring_all_gather", ring_all_gather_bytes(layout.nbytes, nodes), nodes, per_node)
    both = Traffic(*(getattr(rs, f.name) + getattr(ag, f.name) for f in fields(Traffic)))
    # the quantized reduce-scatter (all-to-all) then the all-gather (ring), one after the other
    yield Collective(unit.name, unit.root, "replica_all_reduce", 1, both, 2 * (nodes - 1),
                     encode={codec.bits: (nodes - 1) * chunk + chunk}, decode={codec.bits: (nodes - 1) * chunk + nodes * chunk})  # fmt: skip
