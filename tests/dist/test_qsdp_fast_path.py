"""The QSDP fast path on gloo ranks: prefetch/overlap, one fused codec call per collective, pooled buffers.

- **Prefetch changes nothing but timing:** 6 AdamW steps of the tiny GPT-2 with prefetch on and
  off give bit-identical losses and final weights, for QSDP W8G8, W4G4 (with gradient
  accumulation: two reduce-scatters per unit and step) and stock FSDP2 with
  :func:`qaccel.fsdp.apply_prefetch`; and prefetch really is asynchronous: FSDP2 hands the
  QSDP all-gather ``async_op=True`` and receives a work object, which it waits on.
- **Native calls per collective:** with counting wrappers around every codec entry point of the
  backend in use, each quantized all-gather makes exactly one encode and one decode call, and
  each reduce-scatter one encode and one sum, at world sizes 2 and 4 and for units with 3 and 13
  segments, and no per-segment ``quantize_buckets`` / ``dequantize_into`` call.
- **Pooled buffers:** after the first step, FSDP2's buffers and our blobs come from the pool
  (hits grow, the pool's size stays put), and the reduce-scatter output is never pooled.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from qaccel.comm import DecodeOnWait, WireMeter
from qaccel.fsdp import QSDPConfig, QuantizedAllGather, QuantizedReduceScatter, apply_prefetch, install_qsdp
from qaccel.quant import _backend
from tests._dist import run_ranks
from tests._qsdp_models import batch, build_gpt2, shard_like_accelerate

STEPS = 4


def _train(rank, world_size, config, *, stock_prefetch=False, accumulate=1):
    model = shard_like_accelerate(build_gpt2(seed=0), world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    handle = None
    if config is not None:
        handle = install_qsdp(model, config, optimizers=[optimizer], meter=WireMeter())
    elif stock_prefetch:
        apply_prefetch(model)
    losses = []
    for step in range(STEPS):
        for micro in range(accumulate):
            model.set_requires_gradient_sync(True)
            tokens = batch(rank, step * accumulate + micro)
            loss = model(input_ids=tokens, labels=tokens).loss / accumulate
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    # Raw bytes: exact, and picklable without shared memory (the rank exits before the parent reads).
    weights = [p.to_local().detach().contiguous().view(torch.uint8).numpy().tobytes() for p in model.parameters()]
    return losses, weights, handle


def _prefetch_runs(rank, world_size):
    out = {}
    for name, kwargs in {
        "w8g8": {"weight_bits": 8, "grad_bits": 8},
        "w4g4": {"weight_bits": 4, "grad_bits": 4},
    }.items():
        for prefetch in (True, False):
            accumulate = 2 if name == "w4g4" else 1
            losses, weights, _ = _train(rank, world_size, QSDPConfig(**kwargs, prefetch=prefetch), accumulate=accumulate)
            out[(name, prefetch)] = (losses, weights)
    for prefetch in (True, False):
        losses, weights, _ = _train(rank, world_size, None, stock_prefetch=prefetch)
        out[("stock", prefetch)] = (losses, weights)
    return out


def _async_seen(rank, world_size):
    """Which async_op values the all-gather comm saw, and what it returned for async calls."""
    model = shard_like_accelerate(build_gpt2(seed=0), world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    handle = install_qsdp(model, QSDPConfig(weight_bits=8, grad_bits=8), optimizers=[optimizer], meter=WireMeter())
    seen = []
    for comm in handle.all_gathers:
        original = comm.__call__

        def spy(output_tensor, input_tensor, group, async_op=False, _original=original):
            work = _original(output_tensor, input_tensor, group, async_op)
            if async_op:
                waited = []
                inner_wait = work.wait

                def wait(timeout=None):
                    waited.append(True)
                    return inner_wait(timeout)

                work.wait = wait
                seen.append(("async", type(work).__name__, waited))
            else:
                seen.append(("sync", type(work).__name__, None))
            return work

        # FSDP2 calls the comm object, so patch the instance's class-level call through a subclass.
        comm.__class__ = type("Spied" + type(comm).__name__, (type(comm),), {"__call__": lambda self, *a, _spy=spy, **k: _spy(*a, **k)})
    tokens = batch(rank, 0)
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    return [(mode, kind, None if waited is None else bool(waited)) for mode, kind, waited in seen]


def _world2(rank, world_size):
    # One spawn for every world-2 check: starting ranks costs more than the checks themselves.
    return {
        "prefetch": _prefetch_runs(rank, world_size),
        "async": _async_seen(rank, world_size),
        "pool": _pool_stats(rank, world_size),
        "calls": _calls_per_collective(rank, world_size, 2),
    }


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_ranks(_world2, 2, tmp_path_factory.mktemp("fast_path"), timeout_s=900)


@pytest.fixture(scope="module")
def prefetch_runs(world2):
    return [result["prefetch"] for result in world2]


@pytest.mark.parametrize("name", ["w8g8", "w4g4", "stock"])
def test_prefetch_on_and_off_are_bit_identical(prefetch_runs, name):
    for rank_result in prefetch_runs:
        losses_on, weights_on = rank_result[(name, True)]
        losses_off, weights_off = rank_result[(name, False)]
        assert losses_on == losses_off
        assert weights_on == weights_off


def test_quantized_runs_differ_from_stock(prefetch_runs):
    # Guards the test above against comparing two runs that never quantized anything.
    losses_q, _ = prefetch_runs[0][("w8g8", True)]
    losses_s, _ = prefetch_runs[0][("stock", True)]
    assert losses_q != losses_s


def test_prefetched_all_gathers_are_asynchronous_and_waited(world2):
    for seen in (result["async"] for result in world2):
        asynchronous = [entry for entry in seen if entry[0] == "async"]
        assert asynchronous, f"no all-gather was issued with async_op=True: {seen}"
        assert all(kind == DecodeOnWait.__name__ and waited for _, kind, waited in asynchronous), seen


# -- native calls per collective ------------------------------------------------------------------

_COUNTED = ("encode_payloads", "decode_payloads", "sum_payloads", "quantize_buckets", "dequantize_into")


class _CountingKernels:
    def __init__(self, inner):
        self._inner = inner
        self.calls = {name: 0 for name in _COUNTED}

    def __getattr__(self, name):
        target = getattr(self._inner, name)
        if name not in _COUNTED:
            return target

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return target(*args, **kwargs)

        return counted


def _calls_per_collective(rank, world_size, n_layer):
    counting = _CountingKernels(_backend.kernels_for("cpu"))
    original = _backend.kernels_for
    _backend.kernels_for = lambda device: counting
    try:
        model = shard_like_accelerate(build_gpt2(seed=0, n_layer=n_layer), world_size)
        # One unit holding everything (root) gets many segments; blocks get a handful. Synchronous
        # collectives (no prefetch, no overlapped reduce-scatter), so every call's kernels run inside it.
        config = QSDPConfig(weight_bits=8, grad_bits=4, unit_min_numel=0, prefetch=False, overlap_reduce_scatter=False)
        handle = install_qsdp(model, config, meter=WireMeter())
        per_call = []
        for comm in (*handle.all_gathers, *handle.reduce_scatters):
            if not isinstance(comm, (QuantizedAllGather, QuantizedReduceScatter)):
                continue  # a unit on FSDP2's own collective runs no codec
            inner_call = type(comm).__call__

            def wrapped(self, *args, _inner=inner_call, **kwargs):
                before = dict(counting.calls)
                result = _inner(self, *args, **kwargs)
                if isinstance(result, dist.Work):
                    result.wait()
                delta = {k: counting.calls[k] - before[k] for k in _COUNTED}
                per_call.append((type(self).__name__, len(self.plan.segments), delta))
                return None

            comm.__class__ = type("Counted" + type(comm).__name__, (type(comm),), {"__call__": wrapped})
        tokens = batch(rank, 0)
        model(input_ids=tokens, labels=tokens).loss.backward()
    finally:
        _backend.kernels_for = original
    return per_call


def _check_calls(per_call_of_ranks):
    for per_call in per_call_of_ranks:
        kinds = {kind for kind, _, _ in per_call}
        assert any("AllGather" in k for k in kinds) and any("ReduceScatter" in k for k in kinds), per_call
        segment_counts = {segments for _, segments, _ in per_call}
        assert max(segment_counts) >= 3, segment_counts
        for kind, segments, delta in per_call:
            assert delta["quantize_buckets"] == 0 and delta["dequantize_into"] == 0, (kind, segments, delta)
            assert delta["encode_payloads"] == 1, (kind, segments, delta)
            if "AllGather" in kind:
                assert delta["decode_payloads"] == 1 and delta["sum_payloads"] == 0, (kind, segments, delta)
            else:
                assert delta["sum_payloads"] == 1 and delta["decode_payloads"] == 0, (kind, segments, delta)


def test_one_encode_and_one_decode_call_per_collective_world2(world2):
    _check_calls([result["calls"] for result in world2])


def test_one_encode_and_one_decode_call_per_collective_world4(tmp_path):
    _check_calls(run_ranks(_calls_per_collective, 4, tmp_path, 1))


# -- pooled buffers ------------------------------------------------------------------------------


def _pool_stats(rank, world_size):
    model = shard_like_accelerate(build_gpt2(seed=0), world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    handle = install_qsdp(model, QSDPConfig(weight_bits=8, grad_bits=8), optimizers=[optimizer], meter=WireMeter())
    pool = handle.all_gathers[0].buffers
    assert all(c.buffers is pool for c in (*handle.all_gathers, *handle.reduce_scatters))
    stats = []
    grads_alias_pool = False
    for step in range(3):
        tokens = batch(rank, step)
        model(input_ids=tokens, labels=tokens).loss.backward()
        pooled = {e[0].untyped_storage().data_ptr() for entries in pool._pools.values() for e in entries}
        grads_alias_pool |= any(p.grad.to_local().untyped_storage().data_ptr() in pooled for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        stats.append((pool.hits, pool.misses, pool.nbytes()))
    return stats, grads_alias_pool


def test_buffers_are_reused_across_steps_and_gradients_never_live_in_the_pool(world2):
    for stats, grads_alias_pool in (result["pool"] for result in world2):
        (hits1, misses1, bytes1), (hits2, misses2, bytes2), (hits3, misses3, bytes3) = stats
        assert misses2 == misses1 and misses3 == misses1, stats  # no new buffer after the first step
        assert hits3 - hits2 == hits2 - hits1 > 0, stats
        assert bytes1 == bytes2 == bytes3 > 0
        assert not grads_alias_pool
