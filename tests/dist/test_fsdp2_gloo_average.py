"""Regression guard for pytorch/pytorch#162338 ("Incorrect AVG reduction for GLOO").

Stock FSDP2 over gloo must average gradients, not sum them. qaccel's quantized reduce-scatter
never relies on gloo's AVG (it forces SUM and divides itself), but its pass-through path and every
comparison against stock FSDP2 do; if the upstream bug returns, this test says so first.
The oracle is independent of FSDP: every rank computes the gradient of an unsharded replica on its
own batch, and the test averages those gradients with an all-gather in fp64.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def _stock_fsdp2_grads_equal_manual_average(rank, world_size):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5))
    replica = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)

    data = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 + rank))
    model(data).square().mean().backward()
    replica(data).square().mean().backward()

    worst = 0.0
    for (name, sharded), local in zip(model.named_parameters(), replica.parameters(), strict=True):
        gathered = [torch.empty_like(local.grad) for _ in range(world_size)]
        dist.all_gather(gathered, local.grad)
        manual_average = torch.stack(gathered).double().mean(dim=0)
        fsdp_grad = sharded.grad.full_tensor().double()
        scale = manual_average.abs().max().item() + 1e-12
        worst = max(worst, (fsdp_grad - manual_average).abs().max().item() / scale)
        # A summed (not averaged) gradient would be off by a factor world_size.
        torch.testing.assert_close(fsdp_grad, manual_average, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    return worst


@pytest.mark.parametrize("world_size", [2, 4])  # 33 output rows: uneven shards
def test_stock_fsdp2_gloo_gradients_are_averages(tmp_path, world_size):
    from tests._dist import run_ranks

    worst = run_ranks(_stock_fsdp2_grads_equal_manual_average, world_size, tmp_path)
    assert max(worst) < 1e-5
