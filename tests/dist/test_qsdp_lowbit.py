"""Low-bit QSDP over gloo: rotated codecs and gradient error feedback against plain-torch oracles.

1. The collectives (3 ranks): ``quantized_reduce_scatter`` with error feedback, rotated or not, over
   several calls. Every rank rebuilds every rank's gradients from their seeds and replays the whole
   exchange in plain torch, segment by segment, with the reference codec's primitives
   (``quantize_buckets``, ``dequantize_into``, ``hadamard_rotate``): each source keeps
   ``e = (g + e) - decode(Q(g + e))`` per destination, and each destination sums its own chunk and
   the decoded chunks in source order. The collective must match that replay bit for bit. A
   rotated ``quantized_all_gather`` must decode every owner's chunk as the reference decodes it
   with that owner's seed. As a property check, the error of the running sum of the reduced
   gradients (what an optimizer integrates) must stay bounded with error feedback and grow
   without it.
2. Through ``qaccel.Accelerator`` (2 ranks): W4G2 with both rotations and error feedback saves
   after step 2 and runs on; a fresh run resumed from the checkpoint must end bit-identical to it
   (seeds *and* error buffers restored), while the same resume with the error buffers zeroed must
   not (the control that shows the buffers matter). Resuming on 3 ranks restarts the buffers.
"""

import os

import pytest
import torch
import torch.distributed as dist

from qaccel.comm import PayloadLayout, WireCodec, WireMeter, mix_seed, quantized_all_gather, quantized_reduce_scatter
from qaccel.quant import reference
from tests._accelerate_runs import TINY, full_params, run_step, set_rank_env
from tests._dist import run_ranks

SEGMENTS = ((300, True), (17, False), (200, True), (5, True))  # ragged: a bucket and a rotation block cut short
CHUNK = sum(n for n, _ in SEGMENTS)
CALLS = 6


def _grads(source, call, world, heavy=True):
    """Rank ``source``'s reduce-scatter input of ``call``: heavy-tailed (low bits lose a lot) or Gaussian."""
    gen = torch.Generator().manual_seed(1000 * call + source)
    values = torch.randn(world * CHUNK, generator=gen)
    return values * torch.rand(world * CHUNK, generator=gen).pow(-1.5) if heavy else values


def _seed(call, source, dest):
    return mix_seed(77, call, source, dest)


def _oracle_round_trip(x, codec, seed):
    """decode(encode(x)) for one chunk, segment by segment, from the reference codec's primitives."""
    out = torch.empty(CHUNK, dtype=torch.float32)
    offset = 0
    for index, (numel, quantized) in enumerate(SEGMENTS):
        segment = x[offset : offset + numel].to(torch.float32)
        if not quantized:
            out[offset : offset + numel] = segment
        else:
            segment_seed = mix_seed(seed, index)
            rotated = codec.rotation == "hadamard"
            values = reference.hadamard_rotate(segment, codec.bucket_size, segment_seed) if rotated else segment
            codes, lo, scale = reference.quantize_buckets(
                values, codec.bits, codec.bucket_size, codec.rounding == "nearest", segment_seed, codec.meta_dtype
            )
            decoded = torch.empty(numel, dtype=torch.float32)
            reference.dequantize_into(codes, lo, scale, codec.bits, codec.bucket_size, decoded, False)
            if rotated:
                decoded = reference.hadamard_rotate(decoded, codec.bucket_size, segment_seed, inverse=True)
            out[offset : offset + numel] = decoded
        offset += numel
    return out


def _collectives(rank, world_size, rotation, error_dtype, heavy=True):
    codec = WireCodec(bits=3, bucket_size=64, meta_dtype=torch.bfloat16, rotation=rotation)
    layout = PayloadLayout(segments=SEGMENTS, codec=codec, elem_dtype=torch.float32)
    group, meter = dist.group.WORLD, WireMeter()
    error = torch.zeros((world_size - 1) * CHUNK, dtype=error_dtype) if error_dtype is not None else None
    oracle_errors = {(s, j): torch.zeros(CHUNK, dtype=error_dtype or torch.float32) for s in range(world_size) for j in range(world_size)}
    mismatches, running, exact_running, drift = [], torch.zeros(CHUNK), torch.zeros(CHUNK, dtype=torch.float64), []
    for call in range(CALLS):
        grads = _grads(rank, call, world_size, heavy)
        output = torch.empty(CHUNK)
        quantized_reduce_scatter(
            output, grads, group, layout, [_seed(call, rank, dest) for dest in range(world_size)], meter, "test",
            source_seeds=[_seed(call, source, rank) for source in range(world_size)], error=error,
        )  # fmt: skip
        expected = _grads(rank, call, world_size, heavy)[rank * CHUNK : (rank + 1) * CHUNK].clone()
        for source in range(world_size):  # every pair, so this rank's own buffer is replayed too
            for dest in range(world_size):
                if dest == source:
                    continue
                g = _grads(source, call, world_size, heavy)[dest * CHUNK : (dest + 1) * CHUNK]
                corrected = g + oracle_errors[(source, dest)].to(torch.float32) if error_dtype is not None else g
                decoded = _oracle_round_trip(corrected, codec, _seed(call, source, dest))
                if error_dtype is not None:
                    oracle_errors[(source, dest)] = (corrected - decoded).to(error_dtype)
                if dest == rank:
                    expected = expected + decoded
        if not torch.equal(output, expected):
            mismatches.append(call)
        running += output
        exact_running += sum(_grads(s, call, world_size, heavy)[rank * CHUNK : (rank + 1) * CHUNK].double() for s in range(world_size))
        drift.append(((running.double() - exact_running).norm() / exact_running.norm()).item())
    # This rank's own buffer must equal the oracle's errors of what it sent, in destination order.
    own_errors = [oracle_errors[(rank, j)] for j in range(world_size) if j != rank]
    buffer_matches = error is None or torch.equal(error, torch.cat(own_errors))

    # A rotated all-gather decodes each owner's chunk with that owner's seed.
    chunk = _grads(rank, 99, world_size)[:CHUNK].clone()
    gathered = torch.empty(world_size * CHUNK)
    owner_seeds = [_seed(99, owner, 0) for owner in range(world_size)]
    quantized_all_gather(gathered, chunk, group, layout, owner_seeds[rank], meter, "test", owner_seeds=owner_seeds)
    gather_ok = all(
        torch.equal(gathered[o * CHUNK : (o + 1) * CHUNK], _oracle_round_trip(_grads(o, 99, world_size)[:CHUNK], codec, owner_seeds[o]))
        for o in range(world_size)
    )
    return {"mismatches": mismatches, "buffer_matches": buffer_matches, "gather_ok": gather_ok, "drift": drift}


@pytest.mark.parametrize(("rotation", "error_dtype"), [("none", torch.float32), ("hadamard", torch.float32), ("hadamard", torch.bfloat16), ("hadamard", None)])
def test_reduce_scatter_with_error_feedback_matches_a_plain_torch_replay(tmp_path, rotation, error_dtype):
    for out in run_ranks(_collectives, 3, tmp_path, rotation, error_dtype):
        assert out["mismatches"] == [] and out["buffer_matches"] and out["gather_ok"]


def test_error_feedback_keeps_the_running_sum_close_and_without_it_the_error_grows(tmp_path):
    (tmp_path / "ef").mkdir()
    (tmp_path / "plain").mkdir()
    # Gaussian gradients: with heavy tails one outlier's bucket dominates every call's error alike.
    with_feedback = run_ranks(_collectives, 3, tmp_path / "ef", "hadamard", torch.float32, False)
    without = run_ranks(_collectives, 3, tmp_path / "plain", "hadamard", None, False)
    for fed, plain in zip(with_feedback, without, strict=True):
        # With feedback the running sum's error is one step's rounding error (it does not accumulate);
        # without it the independent errors add up, so after CALLS steps it is clearly larger.
        assert fed["drift"][-1] < 0.6 * plain["drift"][-1]


def test_rotated_collectives_refuse_missing_seeds():
    codec = WireCodec(bits=4, bucket_size=64, rotation="hadamard")
    layout = PayloadLayout(segments=((128, True),), codec=codec, elem_dtype=torch.float32)

    class _Single:
        def size(self):
            return 2

        def rank(self):
            return 0

    with pytest.raises(ValueError, match="owner_seeds"):
        quantized_all_gather(torch.empty(256), torch.zeros(128), _Single(), layout, 1, WireMeter(), "test")
    with pytest.raises(ValueError, match="source_seeds"):
        quantized_reduce_scatter(torch.empty(128), torch.zeros(256), _Single(), layout, [1, 2], WireMeter(), "test")


# -- through qaccel.Accelerator: exact resume with error feedback ------------------------------------

SAVE_AFTER, END = 2, 5


def _accelerator_and_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    from qaccel import Accelerator, QSDPPlugin

    plugin = QSDPPlugin(
        weight_bits=4, grad_bits=2, weight_rotation="hadamard", grad_rotation="hadamard", grad_error_feedback="float32",
        auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["GPT2Block"],
        state_dict_type="SHARDED_STATE_DICT",
    )  # fmt: skip
    accelerator = Accelerator(fsdp_plugin=plugin)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**TINY))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def _uninterrupted(rank, world_size, ckpt_dir):
    set_rank_env(rank, world_size)
    accelerator, model, optimizer = _accelerator_and_model()
    for step in range(SAVE_AFTER):
        run_step(accelerator, model, optimizer, rank, step)
    out = {"error_nbytes": accelerator.qsdp.error_feedback_nbytes(), "describe": accelerator.qsdp.describe()}
    accelerator.save_state(ckpt_dir)
    out["losses"] = [run_step(accelerator, model, optimizer, rank, step) for step in range(SAVE_AFTER, END)]
    out["params_at_end"] = full_params(model)
    accelerator.end_training()
    return out


def _resumed(rank, world_size, ckpt_dir, zero_errors):
    set_rank_env(rank, world_size)
    accelerator, model, optimizer = _accelerator_and_model()
    accelerator.load_state(ckpt_dir)
    restored = {name: tensor.abs().sum().item() for name, tensor in accelerator.qsdp.error_state().items()}
    if zero_errors:
        accelerator.qsdp.load_error_state({}, accelerator.qsdp.world_size)  # every buffer back to zero
    out = {"restored": restored, "step": accelerator.qsdp.seeds.step}
    out["losses"] = [run_step(accelerator, model, optimizer, rank, step) for step in range(SAVE_AFTER, END)]
    out["params_at_end"] = full_params(model)
    accelerator.end_training()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("qsdp_lowbit_resume")
    ckpt = str(tmp_path / "ckpt")
    return run_ranks(_uninterrupted, 2, tmp_path, ckpt), ckpt


def test_error_feedback_is_reported_and_saved_per_rank(saved):
    results, ckpt = saved
    for rank, out in enumerate(results):
        quantized_grad_elements = sum(u["shard_numel"] for u in out["describe"] if u["grads_quantized"])
        # (P-1) chunks of fp32 per quantized unit: at P=2 one shard's worth.
        assert out["error_nbytes"] == 4 * quantized_grad_elements
        assert out["error_nbytes"] == sum(u["error_feedback_bytes"] for u in out["describe"])  # announced at install
        assert os.path.exists(os.path.join(ckpt, f"qaccel_qsdp_error_rank{rank}.safetensors"))


def test_resume_with_error_feedback_is_bit_identical_and_zeroed_buffers_are_not(saved, tmp_path):
    results, ckpt = saved
    (tmp_path / "exact").mkdir()
    (tmp_path / "control").mkdir()
    resumed = run_ranks(_resumed, 2, tmp_path / "exact", ckpt, False)
    control = run_ranks(_resumed, 2, tmp_path / "control", ckpt, True)
    for rank in range(2):
        assert resumed[rank]["step"] == SAVE_AFTER and all(v > 0 for v in resumed[rank]["restored"].values())
        assert resumed[rank]["restored"]
        assert resumed[rank]["params_at_end"] == results[rank]["params_at_end"]
        assert resumed[rank]["losses"] == results[rank]["losses"]
        assert control[rank]["params_at_end"] != results[rank]["params_at_end"]


def test_resume_on_another_world_size_restarts_the_buffers(saved, tmp_path):
    _, ckpt = saved
    for out in run_ranks(_resumed, 3, tmp_path, ckpt, False):
        assert out["step"] == SAVE_AFTER and out["restored"] == {}
        assert all(torch.isfinite(torch.tensor(out["losses"])))
