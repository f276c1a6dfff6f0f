"""The overlapped reduce-scatter on gloo ranks (``QSDPConfig.overlap_reduce_scatter``): timing only, never results.

Reference: the same training with the overlap off (the synchronous comm FSDP2 always had), and for
the quantizer off also stock FSDP2 with no QSDP at all. Every comparison is on raw bytes (stricter
than ``torch.equal``: ``-0.0`` and ``+0.0`` differ): the loss of every micro-batch, every gradient
as ``.grad`` holds it right after each ``loss.backward()`` (called directly, not through
Accelerate), and the final weights, over several AdamW steps on 2 real processes.

- QSDP W8G8, W4G4 (2 micro-batches per step) and the quantizer off, with prefetch, and W8G8 without
  it; every reduce-scatter, the root unit's too (FSDP2 issues that one from its end-of-backward
  callback), really returned with its transport running, and none is pending once backward returns.
- What FSDP2 does with the output that the overlap has to replay: a cast (``reduce_dtype=bf16``
  for fp32 parameters), a user divide factor, an fp16 reduce (FSDP2 divides before and after),
  accumulation across micro-batches with and without ``set_requires_gradient_sync(False)``, and
  ``reshard_after_backward=False``.
- Fallbacks (synchronous calls, results still identical, the reason counted): an all-reduce hook
  that reads the reduced shard, a post-accumulate-grad hook that reads ``.grad`` in backward, and a
  unit whose parameters did not all get a gradient.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from qaccel.comm import WireMeter
from qaccel.fsdp import QSDPConfig, install_qsdp
from tests._dist import run_ranks
from tests._qsdp_models import batch, build_gpt2

STEPS = 3


def _digest(tensors) -> list[str]:
    # Raw bytes of each tensor, hashed (picklable and small); equal digests mean equal bytes.
    return [hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for t in tensors]


def _shard_gpt2(world_size, **fully_shard_kwargs):
    model = build_gpt2(seed=0)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, **fully_shard_kwargs)
    return model


class _Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(48, 80)
        self.b = nn.Linear(48, 80)

    def forward(self, h: torch.Tensor, step: int) -> torch.Tensor:
        return self.a(h) + self.b(h) if step % 2 else self.a(h)


class _TwoHeads(nn.Module):
    """An MLP whose second unit has a head used only on odd steps: FSDP2 then reduces a subset of its parameters."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 48))
        self.heads = _Heads()

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        return self.heads(self.body(x), step).pow(2).mean()


def _abort(grad):
    raise RuntimeError("abort backward")


def _abort_in_backward(module, args, out) -> None:
    (out[0] if isinstance(out, tuple) else out).register_hook(_abort)  # returns None: the output stays as it is


def _train(rank, world_size, qsdp, *, overlap=True, prefetch=True, accumulate=1, no_sync_first=False, mp=None,
           divide_factor=None, reshard_after_backward=True, all_reduce_hook=False, grad_hook=False, two_heads=False,
           raise_at_step=None):  # fmt: skip
    kwargs = {} if mp is None else {"mp_policy": mp}
    if two_heads:
        model = _TwoHeads()
        mesh = init_device_mesh("cpu", (world_size,))
        fully_shard(model.body, mesh=mesh)
        fully_shard(model.heads, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = _shard_gpt2(world_size, **kwargs)
    if divide_factor is not None:
        model.set_gradient_divide_factor(divide_factor)
    if not reshard_after_backward:
        model.set_reshard_after_backward(False)
    if all_reduce_hook:
        for block in model.transformer.h:
            block.set_all_reduce_hook(lambda shard: shard.mul_(0.5))  # reads the reduced shard in backward
    hook_reads = []
    if grad_hook:
        param = model.transformer.h[0].mlp.c_fc.weight
        param.register_post_accumulate_grad_hook(lambda p: hook_reads.append(_digest([p.grad.to_local()])[0]))
    # The sharded parameters: the ones the optimizer updates and FSDP2 puts the reduced gradients on
    # (with reshard_after_backward=False the module holds the unsharded ones between steps).
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    handle = None
    if qsdp is not None:
        config = QSDPConfig(**qsdp, prefetch=prefetch, overlap_reduce_scatter=overlap, unit_min_numel=0 if two_heads else 4096)
        handle = install_qsdp(model, config, optimizers=[optimizer], meter=WireMeter())
    losses, grads, pending = [], [], []
    for step in range(STEPS):
        for micro in range(accumulate):
            model.set_requires_gradient_sync(not (no_sync_first and micro == 0))
            if two_heads:
                gen = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
                loss = model(torch.randn(8, 48, generator=gen), step) / accumulate
            else:
                if step == raise_at_step and micro == 0:
                    # The gradient reaching the first block's output raises: the last block has reduce-scattered by then.
                    hook = model.transformer.h[0].register_forward_hook(_abort_in_backward)
                tokens = batch(rank, step * accumulate + micro)
                loss = model(input_ids=tokens, labels=tokens).loss / accumulate
            if step == raise_at_step and micro == 0:
                # Abort this backward after the last block reduce-scattered, recover as FSDP2 documents it.
                with pytest.raises(RuntimeError, match="abort backward"):
                    loss.backward()
                hook.remove()
                model.reset_iter_state()
                optimizer.zero_grad(set_to_none=True)
                continue
            loss.backward()
            losses.append(loss.item())
            grads.append(_digest(p.grad.to_local() for p in params if p.grad is not None))
            if handle is not None and handle.reduce_scatter_overlap is not None:
                pending.append(handle.reduce_scatter_overlap.pending)
        optimizer.step()
        optimizer.zero_grad()
    overlap_state = None if handle is None else handle.reduce_scatter_overlap
    return {
        "losses": losses,
        "grads": grads,
        "weights": _digest(p.to_local() for p in params),
        "hook_reads": hook_reads,
        "pending_after_backward": pending,
        "overlapped": None if overlap_state is None else overlap_state.overlapped,
        "fallbacks": None if overlap_state is None else dict(overlap_state.fallbacks),
        "dropped": None if overlap_state is None else overlap_state.dropped,
        "units": None if handle is None else len(handle.units),
    }


W8G8 = {"weight_bits": 8, "grad_bits": 8}
W4G4 = {"weight_bits": 4, "grad_bits": 4}
OFF = {"weight_bits": None, "grad_bits": None}

# name -> (QSDP settings or None for stock FSDP2, keyword arguments of _train)
CASES = {
    "w8g8": (W8G8, {}),
    "w8g8-no-prefetch": (W8G8, {"prefetch": False}),
    "w4g4-accumulate": (W4G4, {"accumulate": 2}),
    "quantizer-off": (OFF, {}),
    "w8g8-no-sync-accumulate": (W8G8, {"accumulate": 2, "no_sync_first": True}),
    "w8g8-bf16-reduce-cast": (W8G8, {"mp": MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)}),
    "w8g8-divide-factor": (W8G8, {"divide_factor": 3.0}),
    "off-fp16-reduce": (OFF, {"mp": MixedPrecisionPolicy(reduce_dtype=torch.float16)}),
    "w8g8-keep-unsharded-after-backward": (W8G8, {"reshard_after_backward": False, "accumulate": 2}),
    "all-reduce-hook": (W8G8, {"all_reduce_hook": True}),
    "post-accumulate-grad-hook": (W8G8, {"grad_hook": True}),
    "partial-gradients": (W8G8, {"two_heads": True}),
    "backward-raises": (W8G8, {"raise_at_step": 1}),
}
# FSDP2's recovery from a backward that raised (FSDPModule.reset_iter_state) came after torch 2.11.
HAS_RESET_ITER_STATE = hasattr(FSDPModule, "reset_iter_state")
NEEDS_RESET = pytest.mark.skipif(not HAS_RESET_ITER_STATE, reason="this torch's FSDP2 has no reset_iter_state")
if not HAS_RESET_ITER_STATE:
    del CASES["backward-raises"]
FALLBACK = {"all-reduce-hook": "all-reduce hook", "post-accumulate-grad-hook": "post-accumulate-grad hook", "partial-gradients": "partial gradients"}


def _all_cases(rank, world_size):
    # One spawn for every case: starting ranks costs more than the runs themselves.
    out = {}
    for name, (qsdp, kwargs) in CASES.items():
        out[name] = {overlap: _train(rank, world_size, qsdp, overlap=overlap, **kwargs) for overlap in (True, False)}
    out["stock"] = _train(rank, world_size, None)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(_all_cases, 2, tmp_path_factory.mktemp("rs_overlap"), timeout_s=900)


@pytest.mark.parametrize("name", list(CASES))
def test_overlap_on_and_off_are_bit_identical(runs, name):
    for rank_runs in runs:
        on, off = rank_runs[name][True], rank_runs[name][False]
        assert on["losses"] == off["losses"]
        assert on["grads"] == off["grads"]
        assert on["weights"] == off["weights"]
        assert on["hook_reads"] == off["hook_reads"]
        assert off["overlapped"] is None  # the feature off installs nothing


@pytest.mark.parametrize("name", [name for name in CASES if name not in FALLBACK and name != "backward-raises"])
def test_every_reduce_scatter_overlapped_and_none_is_left_pending(runs, name):
    for rank_runs in runs:
        on = rank_runs[name][True]
        backwards = len(on["losses"])
        synced = backwards // 2 if name.endswith("no-sync-accumulate") else backwards
        assert on["fallbacks"] == {}
        assert on["overlapped"] == synced * on["units"]  # every unit, the root (reduced from FSDP2's callback) too
        assert on["pending_after_backward"] == [0] * backwards


@pytest.mark.parametrize("name", list(FALLBACK))
def test_a_shard_read_in_backward_falls_back_to_the_synchronous_comm(runs, name):
    for rank_runs in runs:
        on = rank_runs[name][True]
        assert on["fallbacks"].get(FALLBACK[name], 0) > 0
        assert on["pending_after_backward"] == [0] * len(on["losses"])
    if name == "post-accumulate-grad-hook":
        assert runs[0][name][True]["hook_reads"]  # the hook really read gradients in backward


def test_quantizer_off_with_overlap_is_stock_fsdp2(runs):
    # An independent reference: FSDP2 without QSDP, whose reduce-scatter is always synchronous on CPU.
    for rank_runs in runs:
        on, stock = rank_runs["quantizer-off"][True], rank_runs["stock"]
        assert on["losses"] == stock["losses"]
        assert on["grads"] == stock["grads"]
        assert on["weights"] == stock["weights"]


def test_quantized_runs_differ_from_stock(runs):
    # Guards the comparisons above against runs that never quantized anything.
    assert runs[0]["w8g8"][True]["losses"] != runs[0]["stock"]["losses"]


# -- the setting itself: reachable like every QSDPConfig field, and no difference for a resume
def test_the_setting_is_on_by_default_and_reaches_the_config_from_every_source():
    from qaccel.integration import QSDPPlugin

    assert QSDPConfig().overlap_reduce_scatter is True
    assert QSDPConfig(overlap_reduce_scatter="off").overlap_reduce_scatter is False
    assert QSDPConfig.from_env({"QACCEL_QSDP_OVERLAP_REDUCE_SCATTER": "0"}).overlap_reduce_scatter is False
    assert QSDPPlugin(overlap_reduce_scatter=False).qsdp_config.overlap_reduce_scatter is False
    with pytest.raises(ValueError, match=r"QSDPConfig.overlap_reduce_scatter=.*must be True/False"):
        QSDPConfig(overlap_reduce_scatter="sometimes")


def test_the_setting_is_no_difference_for_a_resume():
    assert QSDPConfig(overlap_reduce_scatter=True).differences(QSDPConfig(overlap_reduce_scatter=False)) == {}
    assert QSDPConfig.from_dict(QSDPConfig(overlap_reduce_scatter=False).to_dict()) == QSDPConfig(overlap_reduce_scatter=False)


@NEEDS_RESET
def test_a_backward_that_raises_drops_its_pending_reduce_scatter_and_training_goes_on_identically(runs):
    # FSDP2's recovery (reset_iter_state, then the next iteration) drops in-flight gradients; the
    # overlap drops its pending call at the next collective instead of adding it to later gradients.
    for rank_runs in runs:
        on = rank_runs["backward-raises"][True]
        assert on["dropped"] == 1 and on["fallbacks"] == {}
        assert len(on["losses"]) == STEPS - 1
        assert on["pending_after_backward"] == [0] * (STEPS - 1)
