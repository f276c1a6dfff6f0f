"""QSDP comms on real FSDP2 units over gloo (world 2 and 4), against independent references.

Each worker shards a tiny GPT-2 the way Accelerate does (one unit per block, then the root) and
checks one property family: the pass-through path is bit-identical to stock FSDP2; quantized
all-gathers give every rank the same weights (forward and backward re-gathers too); quantized
reduce-scatter lies within the codec's bound of the exact average; bytes equal the formula.
"""

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from qaccel.comm import WireMeter
from qaccel.fsdp import QSDPConfig, install_qsdp
from tests._dist import run_ranks

# Dropout off: the compared runs must see identical computations, not different masks.
TINY = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512, "n_positions": 32, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def build_gpt2(seed=0, **overrides):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**{**TINY, **overrides}))


def shard_like_accelerate(model, world_size, mesh=None):
    mesh = mesh if mesh is not None else init_device_mesh("cpu", (world_size,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(rank, step, vocab=512, size=(4, 16)):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, size, generator=gen)


def train_step(model, optimizer, tokens):
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


class Recorder:
    """Wraps an installed comm to log each call's buffer sizes and a copy of its result."""

    def __init__(self, inner, log, unit):
        self.inner, self.log, self.unit = inner, log, unit

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, *args, **kwargs):
        work = self.inner(output_tensor, input_tensor, group, *args, **kwargs)
        if work is not None:
            work.wait()
        self.log.append((self.unit, input_tensor.numel(), output_tensor.numel(), output_tensor.element_size(), output_tensor.detach().clone()))
        return None


def wrap_comms(handle):
    """Replace every unit's comms by recorders; returns (all_gather_log, reduce_scatter_log)."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    ag_log, rs_log = [], []
    recorder_ag = type("RecAG", (Recorder, AllGather), {})
    recorder_rs = type("RecRS", (Recorder, ReduceScatter), {})
    for unit, ag, rs in zip(handle.units, handle.all_gathers, handle.reduce_scatters, strict=True):
        for module in unit.modules:
            module.set_custom_all_gather(recorder_ag(ag, ag_log, unit.index))
            module.set_custom_reduce_scatter(recorder_rs(rs, rs_log, unit.index))
    return ag_log, rs_log


def formula_chunk_bytes(shapes, world, bits, bucket, meta_size, elem_size, param_min_numel=1024):
    """Section 3.2 bytes of one rank-chunk, derived from parameter shapes (not from qaccel)."""
    segments = []
    for shape in shapes:
        numel = math.ceil(shape[0] / world) * math.prod(shape[1:])
        quantized = len(shape) >= 2 and shape.numel() >= param_min_numel
        if segments and not quantized and not segments[-1][1]:
            segments[-1][0] += numel
        else:
            segments.append([numel, quantized])
    codes = sum(bits * math.ceil(n / 8) for n, q in segments if q)
    buckets = sum(math.ceil(n / bucket) for n, q in segments if q)
    raw = sum(n * elem_size for n, q in segments if not q)
    return sum(n for n, _ in segments), (codes + 3) // 4 * 4 + 2 * meta_size * buckets + (raw + 3) // 4 * 4


# --------------------------------------------------------------------------------------------
def _pass_through_is_stock(rank, world_size):
    stock = shard_like_accelerate(build_gpt2(), world_size)
    hooked = shard_like_accelerate(build_gpt2(), world_size)
    opt_stock = torch.optim.AdamW(stock.parameters(), lr=1e-2)
    opt_hooked = torch.optim.AdamW(hooked.parameters(), lr=1e-2)
    meter = WireMeter()
    handle = install_qsdp(hooked, QSDPConfig(weight_bits=None, grad_bits=None), optimizers=[opt_hooked], meter=meter)
    ag_log, rs_log = wrap_comms(handle)
    for step in range(3):
        train_step(stock, opt_stock, batch(rank, step))
        train_step(hooked, opt_hooked, batch(rank, step))
    mismatched = [
        name
        for (name, a), (_, b) in zip(stock.named_parameters(), hooked.named_parameters(), strict=True)
        if not torch.equal(a.to_local(), b.to_local())
    ]
    # Bytes of the stock collectives: (P-1) * chunk * itemsize per call, from FSDP's own buffers.
    expected = sum((world_size - 1) * inp * size for _, inp, _, size, _ in ag_log)
    expected_rs = sum((world_size - 1) * out * size for _, _, out, size, _ in rs_log)
    totals = meter.totals()
    return mismatched, expected, totals["fsdp.all_gather"].sent_bytes, expected_rs, totals["fsdp.reduce_scatter"].sent_bytes, handle.seeds.step


def test_compression_off_is_bit_identical_to_stock_fsdp2(checks):
    for mismatched, expected_ag, got_ag, expected_rs, got_rs, steps in checks["pass_through"]:
        assert mismatched == []
        assert got_ag == expected_ag > 0
        assert got_rs == expected_rs > 0
        assert steps == 3  # the optimizer post-hook advanced the seed step once per step


# --------------------------------------------------------------------------------------------
def _w8g8_weights_and_bytes(rank, world_size):
    model = shard_like_accelerate(build_gpt2(), world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    meter = WireMeter()
    config = QSDPConfig(weight_bits=8, grad_bits=8, unit_min_numel=0)
    handle = install_qsdp(model, config, optimizers=[optimizer], meter=meter)
    ag_log, rs_log = wrap_comms(handle)
    per_step = []
    outputs = []
    for step in range(2):
        start_ag, start_rs = len(ag_log), len(rs_log)
        train_step(model, optimizer, batch(rank, step))
        per_step.append((ag_log[start_ag:], rs_log[start_rs:], meter.end_step()))
        outputs.append([(unit, out) for unit, _, _, _, out in ag_log[start_ag:]])
    gathered = [None] * world_size
    dist.all_gather_object(gathered, outputs)
    # Independent byte formula per unit from the parameter shapes.
    shapes = {unit.index: [p.shape for p in unit.params] for unit in handle.units}
    problems = []
    for step, (ags, rss, closed) in enumerate(per_step):
        expected_ag = expected_rs = 0
        for unit, inp, _, size, _ in ags:
            numel, blob = formula_chunk_bytes(shapes[unit], world_size, 8, 1024, 4, size)
            if numel != inp:
                problems.append(f"unit {unit}: segment map {numel} != FSDP buffer chunk {inp}")
            expected_ag += (world_size - 1) * blob
        for unit, _, out, size, _ in rss:
            numel, blob = formula_chunk_bytes(shapes[unit], world_size, 8, 1024, 4, size)
            if numel != out:
                problems.append(f"unit {unit}: segment map {numel} != reduce-scatter output {out}")
            expected_rs += (world_size - 1) * blob
        if closed["qsdp.all_gather"].sent_bytes != expected_ag or closed["qsdp.all_gather"].recv_bytes != expected_ag:
            problems.append(f"step {step}: all-gather {closed['qsdp.all_gather']} != {expected_ag}")
        if closed["qsdp.reduce_scatter"].sent_bytes != expected_rs:
            problems.append(f"step {step}: reduce-scatter {closed['qsdp.reduce_scatter']} != {expected_rs}")
        # Forward and backward gathers of one unit within a step decode to identical weights.
        by_unit = {}
        for unit, _, _, _, out in ags:
            by_unit.setdefault(unit, []).append(out)
        for unit, outs in by_unit.items():
            if any(not torch.equal(outs[0], o) for o in outs[1:]):
                problems.append(f"step {step} unit {unit}: re-gathers differ")
    identical = all(
        torch.equal(a, b)
        for other in gathered
        for step_a, step_b in zip(gathered[0], other, strict=True)
        for (_, a), (_, b) in zip(step_a, step_b, strict=True)
    )
    return problems, identical


def test_w8g8_identical_weights_on_all_ranks_and_exact_bytes(checks):
    for problems, identical in checks["w8g8"]:
        assert problems == []
        assert identical, "ranks decoded different unsharded weights"


# --------------------------------------------------------------------------------------------
def _g8_gradients_within_bound(rank, world_size):
    replica = build_gpt2(n_positions=32)
    model = shard_like_accelerate(copy.deepcopy(replica), world_size)
    # Exact weights on the wire (weights off) so the replica computes the same local gradients.
    install_qsdp(model, QSDPConfig(weight_bits=None, grad_bits=8, unit_min_numel=0), meter=WireMeter())
    tokens = batch(rank, 0)
    model(input_ids=tokens, labels=tokens).loss.backward()
    replica(input_ids=tokens, labels=tokens).loss.backward()
    levels = 2**8 - 1
    report = []
    for (name, sharded), (_, plain) in zip(model.named_parameters(), replica.named_parameters(), strict=True):
        local_grads = [torch.empty_like(plain.grad) for _ in range(world_size)]
        dist.all_gather(local_grads, plain.grad.contiguous())
        exact_avg = torch.stack(local_grads).sum(0) / world_size
        rows = math.ceil(plain.shape[0] / world_size)
        lo, hi = rank * rows, min((rank + 1) * rows, plain.shape[0])
        got = sharded.grad.to_local()
        want = exact_avg[lo:hi]
        # Each foreign chunk's bucket unit is at most (max - min) / L of that rank's whole chunk.
        quantized = plain.dim() >= 2 and plain.numel() >= 1024
        bound = torch.zeros(())
        if quantized:
            for other in range(world_size):
                if other != rank and hi > lo:
                    chunk = local_grads[other][lo:hi]
                    bound = bound + (chunk.max() - chunk.min()) / levels / world_size
        err = (got - want).abs().max() if got.numel() else torch.zeros(())
        tol = bound * (1 + 1e-5) + 1e-6 * want.abs().max() + 1e-9 if got.numel() else 0
        report.append((name, quantized, float(err), float(tol), float(bound)))
    return report


def test_g8_reduced_gradients_within_codec_bound_of_exact_average(checks):
    for report in checks["g8"]:
        too_far = [(n, e, t) for n, _, e, t, _ in report if e > t]
        assert too_far == []
        # The check has teeth: quantized gradients are not exact, raw ones are.
        assert any(q and e > 0 for _, q, e, _, _ in report)
        assert all(e <= 1e-6 for _, q, e, _, _ in report if not q)


# --------------------------------------------------------------------------------------------
def _hsdp_is_refused(rank, world_size):
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    fully_shard(model, mesh=mesh)
    assert isinstance(model, FSDPModule)
    try:
        install_qsdp(model, QSDPConfig())
    except NotImplementedError as exc:
        return str(exc)
    return None


def test_hsdp_2d_mesh_is_refused_before_any_collective(checks):
    for message in checks["hsdp"]:
        assert message is not None and "2-D mesh" in message and "HSDP" in message


# --------------------------------------------------------------------------------------------
def _all_checks(rank, world_size):
    """One spawn per world size runs every check (spawning and importing dominate the cost)."""
    results = {
        "pass_through": _pass_through_is_stock(rank, world_size),
        "w8g8": _w8g8_weights_and_bytes(rank, world_size),
        "g8": _g8_gradients_within_bound(rank, world_size),
        "hsdp": _hsdp_is_refused(rank, world_size),  # world 2: a (2, 1) mesh, still 2-D
    }
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda ws: f"world{ws}")
def checks(request, tmp_path_factory):
    per_rank = run_ranks(_all_checks, request.param, tmp_path_factory.mktemp(f"qsdp_comms_{request.param}"))
    return {key: [r[key] for r in per_rank] for key in per_rank[0]}
