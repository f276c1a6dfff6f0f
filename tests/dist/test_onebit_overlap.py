"""``overlap_comm``: the 1-bit all-reduce started per DDP bucket in backward gives bit-identical results.

Each rank trains two copies of the same model from the same start, one with ``overlap_comm=True`` and one
with ``overlap_comm=False`` (the step runs the all-reduce, the path the DeepSpeed parity tests check),
on the same batches, and compares weights and every optimizer state tensor with ``torch.equal`` after
every step. The model has several DDP buckets (a small ``bucket_cap_mb``), a parameter that is unused on
odd steps, and the optimizer also holds a parameter outside the DDP model (its gradient set by hand), so
units complete in different buckets, in the step, or get zeros. The wire meter must show the same bytes
with more calls (one per bucket) when overlapped, and the overlap must have started on every compressed
step.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from qaccel.comm import WireMeter
from qaccel.optim import OneBitAdam, StepKind, ZeroOneAdam, register_ddp_comm_hook
from tests._dist import run_ranks

ZERO_ONE = dict(lr=2e-3, var_freeze_step=5, var_update_scaler=1, local_step_scaler=2, local_step_clipper=4)
ONEBIT = dict(lr=2e-3, freeze_step=4, eps=1e-4)  # eps: a variance from three samples stays finite in 1-bit updates
STEPS = 12


class Stack(nn.Module):
    """An embedding, four linear layers and a branch used only when ``use_branch``."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(8, 24)
        self.layers = nn.ModuleList(nn.Linear(24, 24) for _ in range(4))
        self.branch = nn.Linear(24, 24)
        self.head = nn.Linear(24, 3)

    def forward(self, idx: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = self.table(idx)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        if use_branch:
            h = h + self.branch(h)
        return self.head(h)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    # every table row in every batch: a row without gradient keeps v = 0 and its 1-bit updates divide by eps
    return torch.randperm(16, generator=gen) % 8, torch.randn(16, 3, generator=gen)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN included, which torch.equal never calls equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()] if a.is_floating_point() else a.dtype
    return torch.equal(a.detach().contiguous().view(bits), b.detach().contiguous().view(bits))


def _build(optimizer_cls, hyper: dict, overlap: bool, granularity: str, dtype: torch.dtype):
    torch.manual_seed(0)
    net = Stack().to(dtype)
    extra = nn.Parameter(torch.randn(5, 7).to(dtype))  # in the optimizer, not in the DDP model
    ddp = DistributedDataParallel(net, bucket_cap_mb=0.004, find_unused_parameters=True)  # ~1000 floats a bucket
    meter = WireMeter()
    groups = [
        {"params": [p for n, p in net.named_parameters() if n.endswith("weight")] + [extra], "weight_decay": 0.01},
        {"params": [p for n, p in net.named_parameters() if n.endswith("bias")]},
    ]
    opt = optimizer_cls(groups, wire_meter=meter, overlap_comm=overlap, granularity=granularity, **hyper)
    register_ddp_comm_hook(ddp, opt)
    return net, extra, ddp, opt, meter


def _train_pair(rank, world_size, optimizer_name, granularity, dtype_name):
    optimizer_cls, hyper = (ZeroOneAdam, ZERO_ONE) if optimizer_name == "zero_one" else (OneBitAdam, ONEBIT)
    dtype = getattr(torch, dtype_name)
    runs = {overlap: _build(optimizer_cls, hyper, overlap, granularity, dtype) for overlap in (True, False)}
    kinds, mismatches = [], []
    for step in range(1, STEPS + 1):
        kinds.append(runs[True][3].schedule.next_kind().value)
        for _net, extra, ddp, opt, _ in runs.values():
            opt.zero_grad()
            idx, target = _batch(step, rank)
            loss = ((ddp(idx, use_branch=step % 2 == 0).float() - target) ** 2).mean()
            loss.backward()
            extra.grad = torch.full_like(extra, 0.01 * (rank + 1) * step)
            opt.step()
        (net_on, extra_on, _, opt_on, _), (net_off, extra_off, _, opt_off, _) = runs[True], runs[False]
        for (name, a), b in zip(net_on.named_parameters(), net_off.parameters(), strict=True):
            if not _same_bits(a, b):
                mismatches.append(f"step {step}: weight {name}")
        if not _same_bits(extra_on, extra_off):
            mismatches.append(f"step {step}: extra parameter")
        for index, (p_on, p_off) in enumerate(zip(opt_on.state, opt_off.state, strict=True)):
            state_on, state_off = opt_on.state[p_on], opt_off.state[p_off]
            assert state_on.keys() == state_off.keys()
            for key, value in state_on.items():
                same = _same_bits(value, state_off[key]) if isinstance(value, torch.Tensor) else value == state_off[key]
                if not same:
                    mismatches.append(f"step {step}: state {index} {key}")
    # replicas agree with each other too (the averaged results are decoded from the same bytes)
    flat = torch.cat([p.detach().float().reshape(-1) for p in runs[True][0].parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    totals = {overlap: run[4].totals() for overlap, run in runs.items()}
    onebit = {
        overlap: {kind: (tally.calls, tally.sent_bytes, tally.recv_bytes) for kind, tally in t.items() if kind.startswith("onebit.")}
        for overlap, t in totals.items()
    }
    return {
        "kinds": kinds,
        "mismatches": mismatches,
        "replicas_equal": all(_same_bits(g, gathered[0]) for g in gathered),
        "finite": bool(flat.isfinite().all()),
        "rounds_started": runs[True][3].comm_overlap.rounds_started,
        "rounds_off": runs[False][3].comm_overlap,
        "onebit": onebit,
    }


@pytest.mark.parametrize(
    ("optimizer_name", "granularity", "dtype_name", "world_size"),
    [
        ("zero_one", "tensor", "float32", 3),
        ("zero_one", "group", "float32", 2),
        ("zero_one", "tensor", "bfloat16", 2),
        ("onebit", "tensor", "float32", 2),
        ("onebit", "group", "bfloat16", 3),
    ],
)
def test_overlap_on_and_off_are_bit_identical(tmp_path, optimizer_name, granularity, dtype_name, world_size):
    results = run_ranks(_train_pair, world_size, tmp_path, optimizer_name, granularity, dtype_name, timeout_s=400)
    compressed = {StepKind.ONEBIT_GRADIENT.value, StepKind.ONEBIT_MOMENTUM.value, StepKind.SYNC.value}
    for rank, out in enumerate(results):
        assert out["mismatches"] == [], f"rank {rank}: {out['mismatches'][:5]}"
        assert out["replicas_equal"] and out["finite"]
        kinds = out["kinds"]
        expected_kinds = {"onebit_gradient", "sync", "local"} if optimizer_name == "zero_one" else {"onebit_momentum"}
        assert expected_kinds <= set(kinds), kinds
        # the overlap ran on every compressed step; without overlap_comm nothing was installed
        assert out["rounds_started"] == sum(kind in compressed for kind in kinds)
        assert out["rounds_off"] is None
        on, off = out["onebit"][True], out["onebit"][False]
        assert on.keys() == off.keys() == {"onebit.all_to_all", "onebit.all_gather"}
        for kind in on:
            calls_on, *bytes_on = on[kind]
            calls_off, *bytes_off = off[kind]
            assert bytes_on == bytes_off, kind  # the same bytes ...
            assert calls_on > calls_off, kind  # ... in one call per bucket (plus the step's, for the extra parameter)


def _misuse(rank, world_size):
    torch.manual_seed(0)
    net = Stack()
    ddp = DistributedDataParallel(net, bucket_cap_mb=0.004, find_unused_parameters=True)
    opt = OneBitAdam(net.parameters(), lr=1e-3, freeze_step=2)
    register_ddp_comm_hook(ddp, opt)
    out = {}

    def backward(step):
        idx, target = _batch(step, rank)
        ((ddp(idx, use_branch=True) - target) ** 2).mean().backward()

    for step in (1, 2):
        opt.zero_grad()
        backward(step)
        opt.step()
    assert opt.schedule.next_kind() is StepKind.ONEBIT_MOMENTUM
    backward(3)
    assert opt.comm_overlap.in_flight
    try:
        opt.state_dict()
    except RuntimeError as err:
        out["state_dict"] = str(err)
    try:
        backward(4)  # accumulating without no_sync: the first gradient was already sent
    except RuntimeError as err:
        out["second_backward"] = str(err)
    return out


def test_misuse_under_overlap_gets_clear_errors(tmp_path):
    for out in run_ranks(_misuse, 2, tmp_path):
        assert "call optimizer.step() first" in out["state_dict"]
        assert "second backward" in out["second_backward"] and "no_sync" in out["second_backward"]


def _accumulate_and_clip(rank, world_size):
    """Two micro-batches (the first under no_sync) overlap like one; gradient_clipping turns the overlap off."""
    results = {}
    for label, kwargs in (("on", {}), ("off", {"overlap_comm": False}), ("clip", {"gradient_clipping": 1e3})):
        torch.manual_seed(0)
        net = Stack()
        ddp = DistributedDataParallel(net, bucket_cap_mb=0.004, find_unused_parameters=True)
        opt = ZeroOneAdam(net.parameters(), **{**ZERO_ONE, **kwargs})
        register_ddp_comm_hook(ddp, opt)
        for step in range(1, 10):
            opt.zero_grad()
            with ddp.no_sync():
                idx, target = _batch(step, rank)
                ((ddp(idx, use_branch=True) - target) ** 2).mean().backward()
            idx, target = _batch(step + 50, rank)
            ((ddp(idx, use_branch=True) - target) ** 2).mean().backward()
            opt.step()
        results[label] = ([p.detach().clone() for p in net.parameters()], opt.comm_overlap.rounds_started if opt.comm_overlap else None)
    return {
        "on_equals_off": all(_same_bits(a, b) for a, b in zip(results["on"][0], results["off"][0], strict=True)),
        # a clip threshold that never binds: same maths, but the step runs the all-reduce (the norm is needed first)
        "clip_equals_off": all(_same_bits(a, b) for a, b in zip(results["clip"][0], results["off"][0], strict=True)),
        "rounds": {label: value[1] for label, value in results.items()},
    }


def test_gradient_accumulation_and_clipping(tmp_path):
    for out in run_ranks(_accumulate_and_clip, 2, tmp_path):
        assert out["on_equals_off"]
        assert out["clip_equals_off"]
        assert out["rounds"]["on"] > 0
        assert out["rounds"]["off"] is None
        assert out["rounds"]["clip"] == 0
