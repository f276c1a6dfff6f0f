"""QSDP comms on real FSDP2 units over gloo (world 2, 3 and 4), against independent references.

Each worker shards a tiny GPT-2 the way Accelerate does (one unit per block, then the root). Its
sizes are odd on purpose (width 65, vocabulary 509, 35 positions): dim 0 of most parameters does
not divide by 2, 3 or 4, so FSDP2 pads the shards and the last rank holds fewer rows. Oracles:

- stock FSDP2: the pass-through path must be bit-identical to it;
- the true parameters (``full_tensor()`` before each step): every quantized all-gather output must
  lie within the codec's bound of them, and equal them exactly where a parameter travels raw;
- gradients of an unsharded replica, gathered with a plain ``dist.all_gather``: reduce-scatter
  results must lie within the codec's bound of their sum divided by FSDP2's factor;
- the bytes handed to torch's collectives, counted by wrapping them in the worker (the harness's
  ``CollectiveRecorder``): the meter must record
  exactly those, and each payload must weigh what the codec's ``quantize(...).nbytes`` says its
  segments weigh, plus at most 6 bytes of alignment.
"""

import copy
import functools
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from qaccel.comm import WireMeter
from qaccel.fsdp import QSDPConfig, install_qsdp
from tests._dist import CollectiveRecorder, RankJobs
from tests._qsdp_models import (
    MAX_ALIGNMENT_PADDING,
    batch,
    build_gpt2,
    codec_chunk_bytes,
    is_quantized,
    padded_rows,
    shard_like_accelerate,
    train_step,
)


class Recorder:
    """Wraps an installed comm to log each call's unit and a copy of its result."""

    def __init__(self, inner, log, unit):
        self.inner, self.log, self.unit = inner, log, unit

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, *args, **kwargs):
        work = self.inner(output_tensor, input_tensor, group, *args, **kwargs)
        if work is not None:
            work.wait()
        self.log.append((self.unit, output_tensor.detach().clone()))
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


def gathered_weight_problems(out_flat, true_params, world, bits):
    """Compare one all-gather output with the true parameters; returns (problems, max quantized error)."""
    problems, worst = [], 0.0
    shard_numels = [padded_rows(p.shape, world) * math.prod(p.shape[1:]) for p in true_params]
    chunk = sum(shard_numels)
    if out_flat.numel() != world * chunk:
        return [f"output has {out_flat.numel()} elements, the parameters give {world} x {chunk}"], worst
    for owner in range(world):
        offset = owner * chunk
        for param, numel in zip(true_params, shard_numels, strict=True):
            rows = padded_rows(param.shape, world)
            true = param[owner * rows : min((owner + 1) * rows, param.shape[0])].reshape(-1)
            got = out_flat[offset : offset + true.numel()]
            offset += numel
            if true.numel() == 0:
                continue
            if not is_quantized(param.shape):
                if not torch.equal(got, true):
                    problems.append(f"raw parameter {tuple(param.shape)} owner {owner}: not exact")
                continue
            # Stochastic rounding errs by less than one grid step of the bucket; a bucket's range is
            # at most the range of its parameter's padded shard (zero padding included).
            values = true if true.numel() == numel else torch.cat([true, true.new_zeros(1)])
            unit = float(values.max() - values.min()) / (2**bits - 1)
            err = float((got - true).abs().max())
            worst = max(worst, err)
            if err > unit * (1 + 1e-5) + 1e-7 * float(true.abs().max()):
                problems.append(f"parameter {tuple(param.shape)} owner {owner}: error {err:.3e} > grid step {unit:.3e}")
    return problems, worst


# --------------------------------------------------------------------------------------------
def _pass_through_is_stock(rank, world_size):
    stock = shard_like_accelerate(build_gpt2(), world_size)
    hooked = shard_like_accelerate(build_gpt2(), world_size)
    opt_stock = torch.optim.AdamW(stock.parameters(), lr=1e-2)
    opt_hooked = torch.optim.AdamW(hooked.parameters(), lr=1e-2)
    meter = WireMeter()
    handle = install_qsdp(hooked, QSDPConfig(weight_bits=None, grad_bits=None), optimizers=[opt_hooked], meter=meter)
    recorder = CollectiveRecorder()
    for step in range(3):
        train_step(stock, opt_stock, batch(rank, step))
        with recorder.recording():
            train_step(hooked, opt_hooked, batch(rank, step))
    calls = recorder.byte_rows()
    mismatched = [
        name
        for (name, a), (_, b) in zip(stock.named_parameters(), hooked.named_parameters(), strict=True)
        if not torch.equal(a.to_local(), b.to_local())
    ]
    totals = meter.totals()
    counted = {kind: sum(sent for k, sent, _ in calls if k == kind) for kind in ("all_gather", "reduce_scatter", "all_to_all")}
    metered = {"all_gather": totals["fsdp.all_gather"].sent_bytes, "reduce_scatter": totals["fsdp.reduce_scatter"].sent_bytes, "all_to_all": 0}
    return mismatched, counted, metered, handle.seeds.step


def test_compression_off_is_bit_identical_to_stock_fsdp2(checks):
    for mismatched, counted, metered, steps in checks["pass_through"]:
        assert mismatched == []
        assert metered == counted and counted["all_gather"] > 0 and counted["reduce_scatter"] > 0
        assert steps == 3  # the optimizer post-hook advanced the seed step once per step


# --------------------------------------------------------------------------------------------
def _w8g8_weights_and_bytes(rank, world_size):
    model = shard_like_accelerate(build_gpt2(), world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    meter = WireMeter()
    config = QSDPConfig(weight_bits=8, grad_bits=8, unit_min_numel=0)
    handle = install_qsdp(model, config, optimizers=[optimizer], meter=meter)
    ag_log, rs_log = wrap_comms(handle)
    shapes = {unit.index: [p.shape for p in unit.params] for unit in handle.units}
    problems, outputs, worst = [], [], 0.0
    for step in range(2):
        true = {unit.index: [p.full_tensor().detach().clone() for p in unit.params] for unit in handle.units}
        start_ag, start_rs, recorder = len(ag_log), len(rs_log), CollectiveRecorder()
        with recorder.recording():
            train_step(model, optimizer, batch(rank, step))
        calls = recorder.byte_rows()
        closed = meter.end_step()
        ags, rss = ag_log[start_ag:], rs_log[start_rs:]
        outputs.append(ags)
        # Bytes: the meter records exactly what was handed to torch's collectives ...
        gathers = [c for c in calls if c[0] == "all_gather"]
        to_alls = [c for c in calls if c[0] == "all_to_all"]
        if closed["qsdp.all_gather"].sent_bytes != sum(c[1] for c in gathers) or len(gathers) != len(ags):
            problems.append(f"step {step}: all-gather meter {closed['qsdp.all_gather']} vs collectives {gathers}")
        if closed["qsdp.reduce_scatter"].sent_bytes != sum(c[1] for c in to_alls) or len(to_alls) != len(rss):
            problems.append(f"step {step}: reduce-scatter meter {closed['qsdp.reduce_scatter']} vs collectives {to_alls}")
        # ... and each payload weighs what the codec says its segments weigh, plus alignment.
        for (unit, _), (_, _, payload) in zip(ags, gathers, strict=False):
            expected = codec_chunk_bytes(shapes[unit], world_size, config.weight_codec(), 4)
            if not expected <= payload <= expected + MAX_ALIGNMENT_PADDING:
                problems.append(f"step {step} unit {unit}: all-gather payload {payload} B, codec says {expected} B")
        for (unit, _), (_, _, payload) in zip(rss, to_alls, strict=False):
            expected = codec_chunk_bytes(shapes[unit], world_size, config.grad_codec(), 4)
            if not expected <= payload <= expected + MAX_ALIGNMENT_PADDING:
                problems.append(f"step {step} unit {unit}: reduce-scatter payload {payload} B, codec says {expected} B")
        # Gathered weights lie within the codec bound of the true weights.
        by_unit = {}
        for unit, out in ags:
            unit_problems, unit_worst = gathered_weight_problems(out, true[unit], world_size, 8)
            problems.extend(f"step {step} unit {unit}: {p}" for p in unit_problems)
            worst = max(worst, unit_worst)
            by_unit.setdefault(unit, []).append(out)
        # Forward and backward gathers of one unit within a step decode to identical weights.
        for unit, outs in by_unit.items():
            if any(not torch.equal(outs[0], o) for o in outs[1:]):
                problems.append(f"step {step} unit {unit}: re-gathers differ")
    gathered = [None] * world_size
    dist.all_gather_object(gathered, [[out for _, out in step] for step in outputs])
    identical = all(
        torch.equal(a, b)
        for other in gathered
        for step_a, step_b in zip(gathered[0], other, strict=True)
        for a, b in zip(step_a, step_b, strict=True)
    )
    return problems, identical, worst


def test_w8g8_weights_within_codec_bound_identical_on_all_ranks_and_bytes_as_handed_to_torch(checks):
    for problems, identical, worst in checks["w8g8"]:
        assert problems == []
        assert identical, "ranks decoded different unsharded weights"
        assert worst > 0  # the weights really were quantized: the bound had something to bound


# --------------------------------------------------------------------------------------------
USER_FACTOR = 5.0  # a gradient divide factor that is neither 1 nor any world size under test


def _g8_gradients(rank, world_size, mode):
    """One backward with quantized gradients; ``mode`` says who sets which divide factor, and when.

    ``default``: FSDP2 averages (divides by P); ``before`` / ``after``: the user sets
    ``set_gradient_divide_factor(5)`` before / after ``install_qsdp``; ``avg``: the user switches the
    forced SUM off again, so FSDP2 passes ``ReduceOp.AVG`` to the comm.
    """
    replica = build_gpt2()
    model = shard_like_accelerate(copy.deepcopy(replica), world_size)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if mode == "before":
        for module in units:
            module.set_gradient_divide_factor(USER_FACTOR)
    # Exact weights on the wire (weights off) so the replica computes the same local gradients.
    install_qsdp(model, QSDPConfig(weight_bits=None, grad_bits=8, unit_min_numel=0), meter=WireMeter())
    if mode == "after":
        for module in units:
            module.set_gradient_divide_factor(USER_FACTOR)
    if mode == "avg":
        for module in units:
            module.set_force_sum_reduction_for_comms(False)
    factor = USER_FACTOR if mode in ("before", "after") else float(world_size)
    tokens = batch(rank, 0)
    model(input_ids=tokens, labels=tokens).loss.backward()
    replica(input_ids=tokens, labels=tokens).loss.backward()
    levels = 2**8 - 1
    report = []
    for (name, sharded), (_, plain) in zip(model.named_parameters(), replica.named_parameters(), strict=True):
        local_grads = [torch.empty_like(plain.grad) for _ in range(world_size)]
        dist.all_gather(local_grads, plain.grad.contiguous())
        want_full = torch.stack(local_grads).double().sum(0) / factor
        rows = padded_rows(plain.shape, world_size)
        lo, hi = rank * rows, min((rank + 1) * rows, plain.shape[0])
        got = sharded.grad.to_local().double()
        want = want_full[lo:hi]
        # Each foreign chunk's grid step is at most the range of that rank's padded chunk / L.
        bound = 0.0
        if is_quantized(plain.shape) and hi > lo:
            for other in range(world_size):
                if other != rank:
                    chunk = local_grads[other][lo:hi].reshape(-1)
                    if hi - lo < rows:
                        chunk = torch.cat([chunk, chunk.new_zeros(1)])
                    bound += float(chunk.max() - chunk.min()) / levels / factor
        err = float((got - want).abs().max()) if got.numel() else 0.0
        tol = bound * (1 + 1e-5) + 1e-6 * float(want.abs().max()) + 1e-9 if got.numel() else 0.0
        report.append((name, is_quantized(plain.shape), err, tol))
    return report


def _premul_sum_is_refused(rank, world_size):
    model = shard_like_accelerate(build_gpt2(), world_size)
    install_qsdp(model, QSDPConfig(weight_bits=None, grad_bits=8, unit_min_numel=0), meter=WireMeter())
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(False)  # FSDP2 then passes PREMUL_SUM(1/5)
            module.set_gradient_divide_factor(USER_FACTOR)
    tokens = batch(rank, 0)
    try:
        model(input_ids=tokens, labels=tokens).loss.backward()
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("mode", ["default", "before", "after", "avg"])
def test_g8_reduced_gradients_within_codec_bound_of_the_sum_divided_by_fsdps_factor(checks, mode):
    for report in checks[f"g8_{mode}"]:
        too_far = [(n, e, t) for n, _, e, t in report if e > t]
        assert too_far == []
        # The check has teeth: quantized gradients are not exact, raw ones are (up to fp32 sums).
        assert any(q and e > 0 for _, q, e, _ in report)
        assert all(e <= 1e-6 for _, q, e, _ in report if not q)


def test_a_divide_the_comm_cannot_read_is_refused_with_a_clear_error(checks):
    for message in checks["premul"]:
        assert message is not None and "QuantizedReduceScatter" in message and "set_force_sum_reduction_for_comms(True)" in message


# --------------------------------------------------------------------------------------------
def _microbatch_rounding_errors(rank, world_size):
    """Two micro-batches with the same data, gradient sync on for both (FSDP2 reduce-scatters twice).

    Both reduce-scatters see identical inputs, so their rounding errors are comparable element by
    element: with one seed per step they would be identical (correlation 1); with fresh noise per
    call they are independent (correlation about 0, standard error 1/sqrt(n)).
    """
    replica = build_gpt2()
    model = shard_like_accelerate(copy.deepcopy(replica), world_size)
    handle = install_qsdp(model, QSDPConfig(weight_bits=None, grad_bits=8, unit_min_numel=0), meter=WireMeter())
    tokens = batch(rank, 0)
    model(input_ids=tokens, labels=tokens).loss.backward()
    first = [p.grad.to_local().clone() for p in model.parameters()]
    model(input_ids=tokens, labels=tokens).loss.backward()
    second = [p.grad.to_local() - f for p, f in zip(model.parameters(), first, strict=True)]
    replica(input_ids=tokens, labels=tokens).loss.backward()
    errors_1, errors_2 = [], []
    for plain, g1, g2 in zip(replica.parameters(), first, second, strict=True):
        if not is_quantized(plain.shape) or g1.numel() == 0:
            continue
        local_grads = [torch.empty_like(plain.grad) for _ in range(world_size)]
        dist.all_gather(local_grads, plain.grad.contiguous())
        rows = padded_rows(plain.shape, world_size)
        exact = (torch.stack(local_grads).double().sum(0) / world_size)[rank * rows : rank * rows + g1.shape[0]]
        errors_1.append((g1.double() - exact).reshape(-1))
        errors_2.append((g2.double() - exact).reshape(-1))
    e1, e2 = torch.cat(errors_1), torch.cat(errors_2)
    correlation = float(torch.corrcoef(torch.stack([e1, e2]))[0, 1])
    return correlation, e1.numel(), float(e1.abs().max()), handle.seeds.grad_calls(0)


def test_each_microbatch_reduce_scatter_rounds_with_fresh_noise(checks):
    for correlation, n, max_error, calls in checks["microbatch"]:
        assert n > 10_000 and max_error > 0
        assert calls == 2  # two reduce-scatters of the first unit, before any optimizer step
        # Independent noise: |r| within 5 standard errors (1/sqrt(n)) of 0; identical noise gives 1.
        assert abs(correlation) < 5 / math.sqrt(n), correlation


# --------------------------------------------------------------------------------------------
def _refusals(rank, world_size):
    out = {}
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard")) if world_size % 2 == 0 else None
    if mesh is not None:
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
        fully_shard(model, mesh=mesh)
        try:
            install_qsdp(model, QSDPConfig())
            out["hsdp"] = None
        except NotImplementedError as exc:
            out["hsdp"] = str(exc)
    flat_mesh = init_device_mesh("cpu", (world_size,))

    def mixed(mp_policy=None):
        # A frozen bf16 layer next to a trainable fp32 one (FSDP2 requires one dtype among trainable
        # parameters only): FSDP2 all-gathers the unit as one uint8 byte buffer.
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64).to(torch.bfloat16).requires_grad_(False))
        fully_shard(model, mesh=flat_mesh, **({"mp_policy": mp_policy} if mp_policy else {}))
        return model

    try:
        install_qsdp(mixed(), QSDPConfig(unit_min_numel=0))
        out["mixed"] = None
    except NotImplementedError as exc:
        out["mixed"] = str(exc)
    # One all-gather dtype again (param_dtype casts the fp32 layer): accepted.
    out["mixed_cast_ok"] = install_qsdp(mixed(MixedPrecisionPolicy(param_dtype=torch.bfloat16)), QSDPConfig(unit_min_numel=0)) is not None
    if world_size == 4:  # reshard_after_forward=<int> needs a proper factor > 1 of the shard group size
        def resharded():
            model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
            fully_shard(model[0], mesh=flat_mesh, reshard_after_forward=2)
            fully_shard(model, mesh=flat_mesh)
            return model

        try:
            install_qsdp(resharded(), QSDPConfig(unit_min_numel=0))
            out["reshard_int"] = None
        except NotImplementedError as exc:
            out["reshard_int"] = str(exc)
        # Weights off: the post-forward re-gather moves exact weights, so it is allowed.
        out["reshard_int_weights_off_ok"] = install_qsdp(resharded(), QSDPConfig(weight_bits=None, unit_min_numel=0)) is not None
    return out


def test_hsdp_2d_mesh_is_refused_before_any_collective(checks):
    if checks["world"] % 2:
        pytest.skip("an odd world size has no 2-D (replicate, shard) mesh")
    for out in checks["refusals"]:
        assert out["hsdp"] is not None and "2-D mesh" in out["hsdp"] and "HSDP" in out["hsdp"]


def test_units_with_several_all_gather_dtypes_are_refused(checks):
    for out in checks["refusals"]:
        message = out["mixed"]
        assert message is not None and "several dtypes" in message
        assert "0.weight: torch.float32" in message and "1.weight: torch.bfloat16" in message
        assert out["mixed_cast_ok"]


def test_reshard_after_forward_int_is_refused_with_quantized_weights(checks):
    if checks["world"] != 4:
        pytest.skip("reshard_after_forward=<int> needs a shard group size with a proper factor > 1 (here: 4)")
    for out in checks["refusals"]:
        assert out["reshard_int"] is not None and "reshard_after_forward=2 (an int)" in out["reshard_int"]
        assert out["reshard_int_weights_off_ok"]


# --------------------------------------------------------------------------------------------
CHECKS = {
    "pass_through": _pass_through_is_stock,
    "w8g8": _w8g8_weights_and_bytes,
    **{f"g8_{mode}": functools.partial(_g8_gradients, mode=mode) for mode in ("default", "before", "after", "avg")},
    "microbatch": _microbatch_rounding_errors,
    "refusals": _refusals,
    "premul": _premul_sum_is_refused,
}


def _check(rank, world_size, name):
    return CHECKS[name](rank, world_size)


class _Checks(RankJobs):
    """Each check's per-rank results (one job per check, run when a test first reads it), and ``["world"]``."""

    def __getitem__(self, key: str):
        return self.world_size if key == "world" else super().__getitem__(key)


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda ws: f"world{ws}")
def checks(request, tmp_path_factory):
    return _Checks(_check, request.param, tmp_path_factory)
