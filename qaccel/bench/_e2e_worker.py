"""One configuration of ``qaccel bench e2e``, run by every rank under torchrun.

``python -m qaccel.bench._e2e_worker SPEC.json`` reads the job from a JSON file written by the parent
(``qaccel.bench.e2e``); rank 0 writes the measurements to ``spec["out"]``. First every rank times the
same steps without communication (:func:`compute_only_steps`), then the method's real steps.

Per step: a barrier, the namespace's loopback ``tx_bytes`` and a clock read on rank 0, one training step
(forward, backward, optimizer step), a barrier, the counter and clock again. The loopback carries every
rank's traffic, so the counter difference is the whole job's bytes on the link in that step, plus the two
barriers (a few hundred bytes). Meter bytes are what each rank's meter recorded for the step.

Several nodes (``spec["nodes"]`` > 1, one torchrun per node, ``_e2e_netns.NodeCluster``): the first rank of
every node reads its node's counters instead, ``lo``'s ``tx_bytes`` (intra-node) and its veth's ``tx_bytes``
and ``rx_bytes`` (inter-node), and every rank splits its meter bytes by level: a collective counts as
``inter_node`` when its group spans nodes (every collective of a flat method, the replica all-reduce of
HSDP), ``intra_node`` otherwise; the kinds of the node-sharded ``hqsdp`` methods (hierarchical QSDP's, and
those of a 1-bit optimizer on HSDP shards: ``hsdp.*`` across, ``qsdp.*`` inside) are classified by
``qaccel.fsdp.bytes_by_level``.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from ._e2e_methods import METHODS, MODELS, Method, make_schedule, steady_kinds

__all__ = ["main"]


def _read_counter(path: str) -> int:
    with open(path) as f:
        return int(f.read())


def _build_model(model_name: str) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**MODELS[model_name]["config"]))


def _batch(model_name: str, step: int, rank: int, world_size: int) -> torch.Tensor:
    shape = MODELS[model_name]
    vocab = shape["config"]["vocab_size"]
    generator = torch.Generator().manual_seed(step * world_size + rank)
    return torch.randint(0, vocab, (shape["batch_size"], shape["seq_len"]), generator=generator)


# -- the "ring" meter: torch's own collectives, counted with the same formulas as qaccel's meter --------
@contextmanager
def _ring_meter(meter, levels: dict[str, int] | None = None, nproc_per_node: int = 0):
    """Wrap torch.distributed's flat collectives so every call records its ring bytes in ``meter``.

    FSDP2's default comms and torch's DDP hooks look these functions up at call time, so stock FSDP2,
    PowerSGD and the bf16 compression hook are counted without touching their code. With ``levels``
    (several nodes of ``nproc_per_node`` ranks) each call's bytes are also added to ``levels["inter_node"]``
    when its group spans nodes, else to ``levels["intra_node"]``.
    """
    from ..comm import ring_all_reduce_bytes

    originals = {}
    group_levels: dict[int, str] = {}

    def level_of(group) -> str:  # noqa: ANN001
        key = id(group)
        if key not in group_levels:
            ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
            group_levels[key] = "inter_node" if len({r // nproc_per_node for r in ranks}) > 1 else "intra_node"
        return group_levels[key]

    def wrap(name, count):
        original = getattr(dist, name, None)
        if original is None:
            return

        def wrapper(*args, **kwargs):
            group = kwargs.get("group")
            world = dist.get_world_size(group)
            nbytes = count(args, kwargs, world)
            meter.record(f"torch.{name}", sent_bytes=nbytes, recv_bytes=nbytes)
            if levels is not None:
                levels[level_of(group)] += nbytes
            return original(*args, **kwargs)

        originals[name] = original
        setattr(dist, name, wrapper)

    def gather_bytes(args, kwargs, world):  # (output, input): each rank sends its input to P-1 peers
        tensor = args[1] if len(args) > 1 else kwargs["input_tensor" if "input_tensor" in kwargs else "input"]
        return (world - 1) * tensor.numel() * tensor.element_size()

    def scatter_bytes(args, kwargs, world):  # (output, input): P-1 output-sized chunks each way
        tensor = args[0] if args else kwargs["output"]
        return (world - 1) * tensor.numel() * tensor.element_size()

    def reduce_bytes(args, kwargs, world):
        tensor = args[0] if args else kwargs["tensor"]
        return ring_all_reduce_bytes(tensor.numel() * tensor.element_size(), world)

    for name in ("all_gather_single", "all_gather_into_tensor"):
        wrap(name, gather_bytes)
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        wrap(name, scatter_bytes)
    wrap("all_reduce", reduce_bytes)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


# -- method set-up ----------------------------------------------------------------------------------
def _setup_fsdp(
    method: Method,
    model: torch.nn.Module,
    world_size: int,
    prefetch: bool,
    meter,
    lr: float,
    nproc_per_node: int = 0,
    probe: dict | None = None,
):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from .. import fsdp as qfsdp

    bf16 = method.compute == "bf16"
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    replica_group = None
    if method.mesh == "flat":
        mesh = init_device_mesh("cpu", (world_size,))
    else:  # replicate across nodes, shard within one: global rank = node * nproc_per_node + local rank
        grid = init_device_mesh("cpu", (world_size // nproc_per_node, nproc_per_node), mesh_dim_names=("replicate", "shard"))
        # stock HSDP takes the 2-D mesh; the hqsdp methods shard on the node's mesh and qaccel owns the replica traffic
        mesh = grid if method.mesh == "hsdp" else grid["shard"]
        if method.mesh == "hqsdp":
            replica_group = grid["replicate"].get_group()
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    info: dict = {"prefetch": prefetch}
    schedule = None
    if method.schedule_weighted:
        # the 1-bit optimizer owns the traffic across nodes: QSDP (if any) stays inside the node
        optimizer = _onebit_optimizer(method, model, lr, meter, probe)
        schedule = optimizer.schedule
        info["probe_schedule"] = probe
        qsdp_replica_group = None
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        qsdp_replica_group = replica_group
    if method.qsdp is not None:
        weight_bits, grad_bits = method.qsdp
        if qsdp_replica_group is None:
            config = qfsdp.QSDPConfig(
                weight_bits=weight_bits, grad_bits=grad_bits, prefetch=prefetch, overlap_reduce_scatter=method.overlap_reduce_scatter
            )
        else:
            config = qfsdp.QSDPConfig(
                weight_bits=weight_bits, grad_bits=grad_bits, replica_grad_bits=method.replica_grad_bits, prefetch=prefetch,
                overlap_reduce_scatter=method.overlap_reduce_scatter,
            )  # fmt: skip
        handle = qfsdp.install_qsdp(
            model, config, optimizers=[optimizer], meter=meter, replica_group=qsdp_replica_group
        )
        info["units"] = handle.describe()
        if method.reduce_scatter == "alltoall":
            for unit, installed in zip(handle.units, handle.reduce_scatters, strict=True):
                for module in unit.modules:
                    module.set_custom_reduce_scatter(_alltoall_reduce_scatter_comm(installed, meter))
            info["reduce_scatter"] = "qaccel.comm.alltoall_reduce_scatter (fp32 all-to-all + local sum)"
    elif prefetch:
        # Stock FSDP2 gets the same prefetch setting as QSDP, so the comparison is like for like.
        info["prefetch_links"] = qfsdp.apply_prefetch(model)
    if method.schedule_weighted:
        from ..optim import register_hsdp_comm_hook

        hook = register_hsdp_comm_hook(model, optimizer, replica_group=replica_group, wire_meter=meter)
        info["replica_hook"] = repr(hook)
    return model, optimizer, schedule, info


def _onebit_optimizer(method: Method, model: torch.nn.Module, lr: float, meter, probe: dict | None):
    """``method``'s 1-bit optimizer (0/1 Adam or 1-bit Adam) on ``model``'s parameters, on the probe schedule."""
    from ..optim import OneBitAdam, ZeroOneAdam

    if probe is None:
        raise ValueError(f"{method.name}: a 1-bit optimizer needs the probe schedule (spec['probe']), got none")
    cls = ZeroOneAdam if method.optimizer == "zero_one" else OneBitAdam
    return cls(model.parameters(), lr=lr, wire_meter=meter, overlap_comm=method.overlap_comm, **probe)


_KIND_A2A_RS = "bench.alltoall_reduce_scatter"
SMALL_DDP_BUCKET_MB = 4.0  # ddp_buckets="small": 4 MB of fp32 gradients, 128 KB once 1-bit


def _alltoall_reduce_scatter_comm(installed, meter):  # noqa: ANN001, ANN202
    """The fair baseline's FSDP2 reduce-scatter comm: qaccel's exact all-to-all reduce-scatter.

    Buffers come from the QSDP comm it replaces (``installed``: qaccel's pooled reduce-scatter input);
    the transport is :func:`qaccel.comm.alltoall_reduce_scatter` with FSDP2's op (AVG for fp32), so
    only gloo's all-reduce-based reduce-scatter is swapped out. Bench-only: QSDP's own comms keep
    FSDP2's collective when the codec is off. Built here, not at import, because FSDP2's comm base
    class is private (``_torch_internals``) and the DDP methods do not need it.
    """
    from .._torch_internals import fsdp2_comm_bases
    from ..comm import alltoall_reduce_scatter

    _, reduce_scatter_base = fsdp2_comm_bases()

    class _AllToAllReduceScatter(reduce_scatter_base):
        def allocate(self, size, *, dtype, device):  # noqa: ANN001, ANN202
            return installed.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # noqa: ANN001, ANN202
            return alltoall_reduce_scatter(output_tensor, input_tensor, group, meter, _KIND_A2A_RS, op, async_op=async_op)

    return _AllToAllReduceScatter()


def _setup_ddp(method: Method, model: torch.nn.Module, meter, lr: float, probe: dict | None):
    from torch.nn.parallel import DistributedDataParallel

    info: dict = {}
    if method.ddp_buckets == "small":
        cap_mb = SMALL_DDP_BUCKET_MB
        ddp = DistributedDataParallel(model, bucket_cap_mb=cap_mb)  # an explicit cap sizes the first bucket too
        info["ddp_bucket_cap_mb"] = cap_mb
    elif method.ddp_buckets == "one":
        # an explicit cap also sizes DDP's first bucket, so the whole model is one bucket (docs/powersgd_gloo.md)
        cap_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20 + 1
        ddp = DistributedDataParallel(model, bucket_cap_mb=cap_mb)
        info["ddp_bucket_cap_mb"] = cap_mb
    else:
        ddp = DistributedDataParallel(model)
    schedule = None
    if method.ddp in ("adamw", "powersgd", "bf16"):
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        if method.ddp == "adamw":
            from ..comm import metered_allreduce_hook

            ddp.register_comm_hook(None, metered_allreduce_hook(meter))
        else:
            # Accelerate's own mapping of DistributedDataParallelKwargs(comm_hook=...) to torch's hooks.
            from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

            if method.ddp == "powersgd":
                from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

                options = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}
                # what DistributedDataParallelKwargs(comm_hook=POWER_SGD, comm_state_option=options) registers,
                # with the state kept to report how many buckets PowerSGD compressed
                state = powerSGD_hook.PowerSGDState(None, **options)
                ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
                info["powersgd"] = options
                info["powersgd_gloo"] = ("one DDP bucket: torch's powerSGD_hook deadlocks on gloo when every gloo worker "
                                         "thread waits inside its callbacks (docs/powersgd_gloo.md)")  # fmt: skip
                info["after_run"] = lambda: {"powersgd_buckets_compressed": len(state.error_dict)}
            elif torch.cuda.is_available():
                DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.BF16).register_comm_hook(ddp)
            else:
                ddp.register_comm_hook(None, _bf16_hook_without_cuda())
                info["bf16_hook"] = "torch's bf16_compress_hook, registered under another name (gloo)"
    else:
        from ..optim import register_ddp_comm_hook

        optimizer = _onebit_optimizer(method, model, lr, meter, probe)
        register_ddp_comm_hook(ddp, optimizer)
        schedule = optimizer.schedule
        info["probe_schedule"] = probe
    return ddp, optimizer, schedule, info


def _bf16_hook_without_cuda():
    """torch's ``bf16_compress_hook`` (Accelerate's ``comm_hook=BF16``) for a CPU job over gloo.

    DDP refuses a hook *named* ``bf16_compress_hook`` unless CUDA with NCCL >= 2.10 is present (an NCCL
    limitation); gloo all-reduces bf16 fine, so the same function is registered through a wrapper.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    # unannotated on purpose: DDP rejects the string annotations ``from __future__ import annotations`` makes
    def bf16_hook_over_gloo(state, bucket):  # noqa: ANN001, ANN202
        return bf16_compress_hook(state, bucket)

    return bf16_hook_over_gloo


# -- the measured loop ------------------------------------------------------------------------------
def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> float:
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def run_distributed(spec: dict) -> None:
    from ..comm import WireMeter

    dist.init_process_group("gloo", timeout=_timedelta(spec["pg_timeout_s"]))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    method = METHODS[spec["method"]]
    nodes = _Nodes(spec, rank, world_size) if spec.get("nodes", 1) > 1 else None
    dist.barrier()
    compute = compute_only_steps(spec, rank, world_size)
    gc.collect()
    dist.barrier()
    meter = WireMeter()
    model = _build_model(spec["model"])
    num_params = sum(p.numel() for p in model.parameters())
    if method.parallel == "fsdp":
        nproc = nodes.nproc_per_node if nodes else 0
        model, optimizer, schedule, info = _setup_fsdp(
            method, model, world_size, bool(spec["prefetch"]), meter, spec["lr"], nproc, spec.get("probe")
        )
    else:
        model, optimizer, schedule, info = _setup_ddp(method, model, meter, spec["lr"], spec.get("probe"))
    steps = spec["total_steps"]
    counter = spec["counter_path"]
    records = []
    ring_levels = nodes.ring_levels(method) if nodes else None
    context = _ring_meter(meter, ring_levels, nodes.nproc_per_node if nodes else 0) if method.meter == "ring" else nullcontext()
    with context:
        for step in range(steps):
            kind = schedule.next_kind().value if schedule is not None else "step"
            tokens = _batch(spec["model"], step, rank, world_size)
            dist.barrier()
            link0 = _read_counter(counter) if rank == 0 and not nodes else 0
            node0 = nodes.read() if nodes else None
            start = time.perf_counter()
            loss = _train_step(model, optimizer, tokens)
            dist.barrier()
            seconds = time.perf_counter() - start
            link1 = _read_counter(counter) if rank == 0 and not nodes else 0
            node1 = nodes.read() if nodes else None
            tallies = meter.end_step()
            records.append(
                {
                    "step": step,
                    "kind": kind,
                    "seconds": seconds,
                    "link_bytes": link1 - link0,
                    "meter_sent_bytes": sum(t.sent_bytes for t in tallies.values()),
                    "meter_by_kind": {k: t.sent_bytes for k, t in tallies.items()},
                    "loss": loss,
                }
            )
            if nodes:
                records[-1].update(nodes.step_figures(node0, node1, method, tallies))
    after_run = info.pop("after_run", None)
    if after_run is not None:
        info.update(after_run())
    per_rank_meter = [None] * world_size
    dist.all_gather_object(per_rank_meter, [r["meter_sent_bytes"] for r in records])
    per_rank_compute = [None] * world_size
    dist.all_gather_object(per_rank_compute, statistics.median(r["seconds"] for r in compute if r["steady"]))
    if nodes:
        nodes.gather(records)
        info.update(nodes=nodes.count, nproc_per_node=nodes.nproc_per_node, mesh=method.mesh)
    if rank == 0:
        for i, record in enumerate(records):
            record["meter_sent_bytes_per_rank"] = [ranks[i] for ranks in per_rank_meter]
        if schedule is not None:
            fresh = make_schedule(method.optimizer, spec["probe"])
            for record, (_, steady) in zip(records, steady_kinds(fresh, steps), strict=True):
                record["steady"] = steady
        else:
            for record in records:
                record["steady"] = record["step"] >= spec["warmup"]
        result = {"num_params": num_params, "world_size": world_size, "info": info, "steps": records,
                  "torch_threads": torch.get_num_threads(), "compute_steps_rank0": compute,
                  "compute_median_s_per_rank": per_rank_compute}  # fmt: skip
        if nodes:
            result.update(nodes=nodes.count, nproc_per_node=nodes.nproc_per_node)
        _write(spec["out"], result)
    _free_and_close()


class _Nodes:
    """This rank's place in a several-node job, and the per-step figures by level (module docstring).

    The first rank of each node reads that node's counters around every step; at the end rank 0 collects
    them (:meth:`gather`) into per-step totals: ``intra_node_bytes`` (every node's ``lo``), ``inter_node_bytes``
    (every node's veth ``tx``, each inter-node byte counted once, where it leaves its node) and
    ``inter_node_busiest_direction_bytes`` (the most any shaped direction carried, which sets the link time).
    """

    def __init__(self, spec: dict, rank: int, world_size: int) -> None:
        self.count = int(spec["nodes"])
        self.nproc_per_node = int(spec["nproc_per_node"])
        if world_size != self.count * self.nproc_per_node:
            raise RuntimeError(f"world size {world_size} != {self.count} nodes x {self.nproc_per_node} ranks")
        self.node = rank // self.nproc_per_node
        group_rank = os.environ.get("GROUP_RANK")  # torchrun's node rank: ranks must be numbered node by node
        if group_rank is not None and int(group_rank) != self.node:
            raise RuntimeError(f"rank {rank} runs on node {group_rank}, expected node {self.node} (rank // nproc_per_node)")
        self.reader = rank % self.nproc_per_node == 0
        self.paths = spec["node_counters"][self.node]
        self._ring: dict[str, int] | None = None

    def read(self) -> dict[str, int] | None:
        return {key: _read_counter(path) for key, path in self.paths.items()} if self.reader else None

    def ring_levels(self, method: Method) -> dict[str, int] | None:
        """The dict the ring meter adds each collective's bytes to, by level (None: not a ring-metered method)."""
        self._ring = {"intra_node": 0, "inter_node": 0} if method.meter == "ring" else None
        return self._ring

    def step_figures(self, before: dict | None, after: dict | None, method: Method, tallies: dict) -> dict:
        """This rank's share of one step: its node's counter deltas (first rank of a node) and its meter bytes by level."""
        if method.mesh == "hqsdp":
            from ..fsdp import bytes_by_level

            levels = dict(bytes_by_level(tallies))
        elif self._ring is not None:  # the ring meter's split (by each collective's group), restarted every step
            levels = dict(self._ring)
            self._ring.update(intra_node=0, inter_node=0)
        else:  # a flat method: every qaccel collective runs over all ranks, which span the nodes
            levels = {"intra_node": 0, "inter_node": sum(t.sent_bytes for t in tallies.values())}
        node_bytes = {key: after[key] - before[key] for key in after} if self.reader else None
        return {"node_bytes": node_bytes, "meter_by_level": levels}

    def gather(self, records: list[dict]) -> None:
        """Collect every rank's per-step figures on rank 0 and add the per-step totals there."""
        mine = [(r.pop("node_bytes"), r.pop("meter_by_level")) for r in records]
        everyone: list = [None] * (self.count * self.nproc_per_node)
        dist.all_gather_object(everyone, mine)
        if dist.get_rank() != 0:
            return
        for i, record in enumerate(records):
            per_node = [everyone[k * self.nproc_per_node][i][0] for k in range(self.count)]
            record["node_bytes"] = per_node
            record["intra_node_bytes"] = sum(n["lo"] for n in per_node)
            record["inter_node_bytes"] = sum(n["inter_tx"] for n in per_node)
            record["inter_node_busiest_direction_bytes"] = max(max(n["inter_tx"], n["inter_rx"]) for n in per_node)
            record["link_bytes"] = record["intra_node_bytes"] + record["inter_node_bytes"]
            record["meter_by_level_per_rank"] = [ranks[i][1] for ranks in everyone]


def compute_only_steps(spec: dict, rank: int, world_size: int) -> list[dict]:
    """Same model, per-rank batch and optimizer without any communication: the compute time of one step.

    Every rank runs this at the start of its job, all ranks at once, so the CPU contention is the job's.
    bf16 mirrors FSDP2's mixed precision: forward/backward on a bf16 copy of the weights, gradients cast to
    fp32 for the fp32 AdamW step, weights cast back to bf16. The optimizer covers the whole model (exact for
    DDP; FSDP2 steps only its shard, so this slightly overstates its compute).
    """
    import copy

    model = _build_model(spec["model"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"])
    low = copy.deepcopy(model).to(torch.bfloat16) if METHODS[spec["method"]].compute == "bf16" else None
    records = []
    for step in range(spec["compute_steps"]):
        tokens = _batch(spec["model"], step, rank, world_size)
        start = time.perf_counter()
        if low is None:
            _train_step(model, optimizer, tokens)
        else:
            low(input_ids=tokens, labels=tokens).loss.backward()
            with torch.no_grad():
                for p, q in zip(model.parameters(), low.parameters(), strict=True):
                    p.grad = q.grad.float()
                    q.grad = None
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for p, q in zip(model.parameters(), low.parameters(), strict=True):
                    q.copy_(p)
        records.append({"step": step, "seconds": time.perf_counter() - start, "steady": step >= spec["warmup"]})
    return records


# -- plumbing ---------------------------------------------------------------------------------------
def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


def _write(path: str, data: dict) -> None:
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def _free_and_close() -> None:
    # Free FSDP/DDP state while gloo is still up (collected at interpreter exit it can abort the process).
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    torch.set_num_threads(int(spec["threads"]))
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    run_distributed(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
