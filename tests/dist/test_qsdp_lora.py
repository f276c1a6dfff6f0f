"""QSDP on a LoRA model (``peft``) over gloo, 2 ranks: frozen base weights, trainable adapters.

FSDP2 all-gathers every parameter of a unit but reduce-scatters only the gradients of those that
require grad. The units of a LoRA model mix both, so the reduce-scatter's segment map must be
built from the trainable parameters alone. Oracles, independent of the plan code:

- the model's own ``named_parameters()`` (names, shapes, ``requires_grad``) gives which parameters
  each unit moves in each direction; the comms' real buffer lengths must match them;
- the bytes handed to torch's collectives (wrapped ``dist`` calls): each payload weighs what the
  codec's ``quantize(...).nbytes`` says the listed parameters weigh, and the meter records them;
- stock FSDP2 on the same LoRA model: QSDP with both paths off is bit-identical to it, and with
  8-bit gradients the adapters' gradients lie within the codec's bound of stock FSDP2's.
"""

import copy
import logging
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from qaccel.comm import WireMeter
from qaccel.fsdp import QSDPConfig, install_qsdp
from tests._dist import CollectiveRecorder, run_ranks
from tests._qsdp_models import MAX_ALIGNMENT_PADDING, batch, build_gpt2, codec_chunk_bytes, padded_rows

pytest.importorskip("peft")

WORLD = 2


def build_lora_gpt2(seed=0):
    """Tiny GPT-2 with LoRA on ``c_attn`` and ``c_proj``; B initialised random so A gets a gradient."""
    from peft import LoraConfig, get_peft_model

    model = build_gpt2(seed)
    torch.manual_seed(seed + 1)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj"], init_lora_weights=False, fan_in_fan_out=True)
    return get_peft_model(model, config)


def shard_peft_like_accelerate(peft_model, mesh):
    for block in peft_model.base_model.model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(peft_model, mesh=mesh)
    return peft_model


def unit_parameters(model):
    """``{unit name: [(name, shape, requires_grad)]}`` from ``named_parameters()``: one unit per block, the root."""
    blocks = [f"base_model.model.transformer.h.{name}" for name, _ in model.base_model.model.transformer.h.named_children()]
    units = {block: [] for block in blocks} | {"<root>": []}
    for name, param in model.named_parameters():
        key = next((block for block in blocks if name.startswith(block + ".")), "<root>")
        units[key].append((name, tuple(param.shape), param.requires_grad))
    return units


def train_step(model, optimizer, tokens):
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _plans_bytes_and_gradients(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    base = build_lora_gpt2()
    listed = unit_parameters(base)
    trainable_opt = lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)  # noqa: E731

    # 1. Plans and bytes with W8G8 on every unit.
    model = shard_peft_like_accelerate(copy.deepcopy(base), mesh)
    optimizer = trainable_opt(model)
    meter = WireMeter()
    config = QSDPConfig(weight_bits=8, grad_bits=8, unit_min_numel=0)
    warnings = _Warnings()
    logging.getLogger("qaccel.fsdp").addHandler(warnings)
    handle = install_qsdp(model, config, optimizers=[optimizer], meter=meter)
    out["plans"] = [
        (unit.name, sum(n for n, _ in plan.segments), sum(n for n, _ in grad_plan.segments))
        for unit, plan, grad_plan in zip(handle.units, handle.plans, handle.grad_plans, strict=True)
    ]
    out["describe"] = handle.describe()
    recorder = CollectiveRecorder()
    with recorder.recording():
        train_step(model, optimizer, batch(rank, 0))
    logging.getLogger("qaccel.fsdp").removeHandler(warnings)
    out["warnings"] = warnings.messages
    out["calls"] = recorder.byte_rows()
    out["metered"] = {kind: total.sent_bytes for kind, total in meter.end_step().items()}
    weight_codec, grad_codec = config.weight_codec(), config.grad_codec()
    out["expected_ag"] = {key: codec_chunk_bytes([torch.Size(s) for _, s, _ in ps], world_size, weight_codec, 4) for key, ps in listed.items()}
    out["expected_rs"] = {key: codec_chunk_bytes([torch.Size(s) for _, s, t in ps if t], world_size, grad_codec, 4) for key, ps in listed.items()}
    out["listed_numel"] = {
        key: (sum(padded_rows(s, world_size) * math.prod(s[1:]) for _, s, _ in ps), sum(padded_rows(s, world_size) * math.prod(s[1:]) for _, s, t in ps if t))
        for key, ps in listed.items()
    }

    # 2. Both paths off: bit-identical to stock FSDP2 over three steps.
    stock = shard_peft_like_accelerate(copy.deepcopy(base), mesh)
    hooked = shard_peft_like_accelerate(copy.deepcopy(base), mesh)
    opt_stock, opt_hooked = trainable_opt(stock), trainable_opt(hooked)
    install_qsdp(hooked, QSDPConfig(weight_bits=None, grad_bits=None), optimizers=[opt_hooked], meter=WireMeter())
    for step in range(3):
        train_step(stock, opt_stock, batch(rank, step))
        train_step(hooked, opt_hooked, batch(rank, step))
    out["off_mismatched"] = [
        name for (name, a), (_, b) in zip(stock.named_parameters(), hooked.named_parameters(), strict=True) if not torch.equal(a.to_local(), b.to_local())
    ]

    # 3. 8-bit gradients (exact weights): adapters' gradients within the codec bound of stock FSDP2's.
    stock = shard_peft_like_accelerate(copy.deepcopy(base), mesh)
    quantized = shard_peft_like_accelerate(copy.deepcopy(base), mesh)
    replica = copy.deepcopy(base)
    install_qsdp(quantized, QSDPConfig(weight_bits=None, grad_bits=8, unit_min_numel=0, param_min_numel=256), meter=WireMeter())
    tokens = batch(rank, 7)
    for m in (stock, quantized, replica):
        m(input_ids=tokens, labels=tokens).loss.backward()
    report = []
    for (name, s), (_, q), (_, plain) in zip(stock.named_parameters(), quantized.named_parameters(), replica.named_parameters(), strict=True):
        if not plain.requires_grad:
            report.append((name, None, q.grad is None and s.grad is None, 0.0))
            continue
        local_grads = [torch.empty_like(plain.grad) for _ in range(world_size)]
        dist.all_gather(local_grads, plain.grad.contiguous())
        rows = padded_rows(plain.shape, world_size)
        lo, hi = rank * rows, min((rank + 1) * rows, plain.shape[0])
        bound = 0.0
        for other in range(world_size):
            if other != rank and hi > lo:
                chunk = local_grads[other][lo:hi].reshape(-1)
                chunk = chunk if hi - lo == rows else torch.cat([chunk, chunk.new_zeros(1)])
                bound += float(chunk.max() - chunk.min()) / 255 / world_size
        want, got = s.grad.to_local().double(), q.grad.to_local().double()
        err = float((got - want).abs().max()) if got.numel() else 0.0
        tol = bound * (1 + 1e-4) + 1e-6 * float(want.abs().max()) if got.numel() else 0.0
        report.append((name, math.prod(plain.shape) >= 256, err, tol))
    out["grads"] = report
    return out


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    return run_ranks(_plans_bytes_and_gradients, WORLD, tmp_path_factory.mktemp("qsdp_lora"))


def test_frozen_parameters_leave_the_gradient_plan_and_stay_in_the_weight_plan(lora):
    for out in lora:
        listed = out["listed_numel"]
        assert sorted(name for name, _, _ in out["plans"]) == sorted(listed)
        for name, ag_numel, rs_numel in out["plans"]:
            assert (ag_numel, rs_numel) == listed[name], name
            if name == "<root>":
                assert rs_numel == 0  # embeddings and the final norm: all frozen
            else:
                assert 0 < rs_numel < ag_numel  # adapters only, the base weights left out
        assert [d["grad_shard_numel"] for d in out["describe"]] == [rs for _, _, rs in out["plans"]]
        # The real buffers matched the plans: no fallback to uniform buckets.
        assert not [m for m in out["warnings"] if "falling back" in m]


def test_wire_bytes_are_what_the_plans_say(lora):
    for out in lora:
        gathers = [c for c in out["calls"] if c[0] == "all_gather"]
        to_alls = [c for c in out["calls"] if c[0] == "all_to_all"]
        expected_ag, expected_rs = out["expected_ag"], out["expected_rs"]
        # Each all-gather moves one unit's codes; every payload is one of the units' planned sizes.
        for _, _, payload in gathers:
            assert any(e <= payload <= e + MAX_ALIGNMENT_PADDING for e in expected_ag.values()), (payload, expected_ag)
        # One reduce-scatter per block (the root has no gradient), each the trainable parameters' codes.
        block_rs = sorted(v for k, v in expected_rs.items() if k != "<root>")
        assert len(to_alls) == len(block_rs)
        for (_, _, payload), want in zip(sorted(to_alls, key=lambda c: c[2]), block_rs, strict=True):
            assert want <= payload <= want + MAX_ALIGNMENT_PADDING
        assert out["metered"]["qsdp.all_gather"] == sum(c[1] for c in gathers)
        assert out["metered"]["qsdp.reduce_scatter"] == sum(c[1] for c in to_alls)
        assert "fsdp.reduce_scatter" not in out["metered"]


def test_both_paths_off_is_bit_identical_to_stock_fsdp2_on_lora(lora):
    for out in lora:
        assert out["off_mismatched"] == []


def test_lora_gradients_within_the_codec_bound_of_stock_fsdp2(lora):
    for out in lora:
        frozen = [r for r in out["grads"] if r[1] is None]
        assert frozen and all(no_grad for _, _, no_grad, _ in frozen)
        trainable = [r for r in out["grads"] if r[1] is not None]
        assert [(n, e, t) for n, _, e, t in trainable if e > t] == []
        assert any(q and e > 0 for _, q, e, _ in trainable)  # quantized, hence not exact: the bound has teeth
        assert all(e <= 1e-6 for _, q, e, _ in trainable if not q)
