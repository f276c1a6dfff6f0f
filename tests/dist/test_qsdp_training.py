"""Training with QSDP on 2 gloo ranks: GPT-2 loss next to stock FSDP2, and master-weight mode B.

One spawn runs every variant in the same processes, with the same initial weights and data.

Tolerance of the loss comparison (stated here and in the README): over the last 5 of 40 AdamW
steps the mean loss of W8G8 must be within 1% of stock FSDP2 and W4G4 within 3%. Why: the
quantizers are unbiased, so the runs differ only by rounding noise. At 8 bits the noise per
element is below 1/255 of a 1024-element bucket's range, far under AdamW's per-step change; at 4
bits with 128-element buckets it is 1/15 of a smaller range, which the design doc's prototype saw
cost about 2% after 30 steps (``shared/design/qsdp.md`` section 3.3). Measured here: +0.01% (W8G8)
and +0.7% (W4G4). Both bounds leave room for seed-to-seed variation while still catching a
broken path (a wrong divide, a stalled W4 with 1024-element buckets, or decoded garbage, all of
which move the loss by far more).
"""

import math

import torch
import torch.distributed as dist

from qaccel.comm import WireMeter
from qaccel.fsdp import QSDPConfig, install_qsdp
from tests._dist import run_ranks
from tests.dist.test_qsdp_comms import build_gpt2, shard_like_accelerate

STEPS = 40
VOCAB = 512


def bigram_batch(rank, step, size=(8, 32)):
    """A learnable next-token task: a fixed random chain with 4 successors per token."""
    successors = torch.randint(0, VOCAB, (VOCAB, 4), generator=torch.Generator().manual_seed(123))
    gen = torch.Generator().manual_seed(10_000 * rank + step)
    tokens = torch.empty(size, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (size[0],), generator=gen)
    for t in range(1, size[1]):
        tokens[:, t] = successors[tokens[:, t - 1], torch.randint(0, 4, (size[0],), generator=gen)]
    return tokens


def train(rank, world_size, config, steps=STEPS, after_step=None):
    model = shard_like_accelerate(build_gpt2(seed=0), world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    handle = install_qsdp(model, config, optimizers=[optimizer], meter=WireMeter()) if config is not None else None
    losses = []
    for step in range(steps):
        tokens = bigram_batch(rank, step)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
        if after_step is not None:
            after_step(model, handle)
    return losses


def grid_residuals(model, handle, bucket, bits):
    """Max distance to the nearest grid point, in grid units, over every quantized bucket.

    The layout is rebuilt here from the parameter shapes: each parameter's local shard padded with
    zeros to ``ceil(dim0 / P) * rest``; 2-D parameters with >= 1024 elements quantized; buckets
    restarting per parameter. The grid of a bucket is ``min + k * (max - min) / (2**bits - 1)``.
    """
    levels = 2**bits - 1
    worst = 0.0
    for unit in handle.units:
        world = unit.world_size
        flat = []
        for param in unit.params:
            padded = torch.zeros(math.ceil(param.shape[0] / world) * math.prod(param.shape[1:]))
            local = param.to_local().detach().reshape(-1)
            padded[: local.numel()] = local
            flat.append((padded, param.dim() >= 2 and param.numel() >= 1024))
        for values, quantized in flat:
            if not quantized:
                continue
            for start in range(0, values.numel(), bucket):
                chunk = values[start : start + bucket].double()
                span = chunk.max() - chunk.min()
                if span == 0:
                    continue
                y = (chunk - chunk.min()) / (span / levels)
                worst = max(worst, float((y - y.round()).abs().max()))
    return worst


def _training_runs(rank, world_size):
    results = {
        "stock": train(rank, world_size, None),
        "w8g8": train(rank, world_size, QSDPConfig(weight_bits=8, grad_bits=8)),
        "w4g4": train(rank, world_size, QSDPConfig(weight_bits=4, grad_bits=4)),
        # Reproducible from the seed: the same seed repeats the run exactly, another one does not.
        "w8g8_again": train(rank, world_size, QSDPConfig(weight_bits=8, grad_bits=8), steps=5),
        "w8g8_seed1": train(rank, world_size, QSDPConfig(weight_bits=8, grad_bits=8, seed=1), steps=5),
    }
    residuals = {"quantized": [], "fresh": []}
    for mode in residuals:
        config = QSDPConfig(weight_bits=8, grad_bits=8, master_weights=mode, unit_min_numel=0)
        train(rank, world_size, config, steps=3, after_step=lambda m, h, mode=mode: residuals[mode].append(grid_residuals(m, h, 1024, 8)))
    results["residuals"] = residuals
    return results


def _tail_mean(losses, n=5):
    return sum(losses[-n:]) / n


def test_gpt2_loss_decreases_and_tracks_stock_fsdp2(tmp_path):
    results = run_ranks(_training_runs, 2, tmp_path)
    rank0 = results[0]
    assert results[1]["stock"] == rank0["stock"]  # the all-reduced loss is the same on both ranks
    stock = _tail_mean(rank0["stock"])
    for name, tolerance in (("w8g8", 0.01), ("w4g4", 0.03)):
        losses = rank0[name]
        assert all(math.isfinite(x) for x in losses)
        assert _tail_mean(losses) < losses[0] - 0.5, f"{name} did not learn: {losses[0]:.3f} -> {_tail_mean(losses):.3f}"
        assert abs(_tail_mean(losses) - stock) <= tolerance * stock, f"{name}: {_tail_mean(losses):.4f} vs stock {stock:.4f}"
    assert rank0["w8g8_again"] == rank0["w8g8"][:5]
    assert rank0["w8g8_seed1"] != rank0["w8g8"][:5]
    # Mode B: after every step each stored shard lies on its quantization grid (up to fp rounding);
    # mode fresh keeps full-precision shards, far off the grid, so the check can fail.
    for rank_results in results:
        assert max(rank_results["residuals"]["quantized"]) < 1e-3
        assert min(rank_results["residuals"]["fresh"]) > 0.1
