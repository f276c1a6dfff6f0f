"""The entry's baseline options on 2 real ranks over gloo (``qaccel.training.comm_options.install_comm_options``).

Oracles: Accelerate's own registration of torch's PowerSGD hook (same gradients bit for bit), the bf16 hook's
arithmetic written out in plain torch, stock FSDP2's gradients (the all-to-all reduce-scatter), and
``tests._collectives.CollectiveRecorder``'s bytes for what the wire meter records.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from tests._dist import run_ranks


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    # two matrices PowerSGD compresses (rank 1: (n + m) elements each) and biases it sends whole
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * step + rank))


def _hooks_worker(rank: int, world: int) -> dict:
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
    from torch.nn.parallel import DistributedDataParallel

    from qaccel.comm import WireMeter
    from qaccel.training.comm_options import CommOptions, install_comm_options
    from tests._collectives import CollectiveRecorder

    out: dict = {}
    for hook in ("powersgd", "bf16", "none"):  # none: a stock DDP run (--method none), its all-reduce metered
        options = CommOptions(ddp_comm_hook=hook, ddp_bucket_cap_mb=1.0, powersgd_start_iter=2)
        model = DistributedDataParallel(_mlp(), bucket_cap_mb=1.0)  # one bucket, as on gloo PowerSGD needs
        accelerator = SimpleNamespace(wire_meter=WireMeter(), qsdp=None)
        installed = install_comm_options(accelerator, model, options, stock_ddp=True)
        reference = DistributedDataParallel(_mlp(), bucket_cap_mb=1.0)  # no hook: DDP's own all-reduce
        if hook == "powersgd":  # what Accelerate registers for DistributedDataParallelKwargs(comm_hook=POWER_SGD)
            kwargs = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.POWER_SGD, comm_state_option={"start_powerSGD_iter": 2})
            kwargs.register_comm_hook(reference)
        plain = _mlp()  # no DDP: this rank computes both ranks' local gradients for the bf16 arithmetic
        recorder = CollectiveRecorder()
        steps = []
        for step in range(4):
            with recorder.recording():
                model(_batch(step, rank)).square().mean().backward()
            meter = accelerator.wire_meter.end_step()
            recorded = sum(call.sent_bytes for call in recorder.take() if call.family == "all_reduce")
            record = {"meter": {k: t.sent_bytes for k, t in meter.items()}, "recorded": recorded}
            got = [p.grad.clone() for p in model.parameters()]
            if hook in ("powersgd", "none"):
                reference(_batch(step, rank)).square().mean().backward()
                record["equal"] = all(torch.equal(a, p.grad) for a, p in zip(got, reference.parameters(), strict=True))
            else:
                local = []
                for source in range(world):
                    plain.zero_grad(set_to_none=True)
                    plain(_batch(step, source)).square().mean().backward()
                    local.append([p.grad.to(torch.bfloat16).div(world) for p in plain.parameters()])
                expected = [sum(parts[1:], parts[0]).float() for parts in zip(*local, strict=True)]
                record["equal"] = all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
            for m in (model, reference):
                m.zero_grad(set_to_none=True)
            steps.append(record)
        out[hook] = {"installed": installed, "steps": steps}
    return out


def test_powersgd_bf16_and_stock_hooks_train_as_torchs_and_meter_their_bytes(tmp_path):
    params = sum(p.numel() for p in _mlp().parameters())  # 32*64 + 64 + 64*16 + 16 = 3152
    compressed = (64 + 32) + 64 + (16 + 64) + 16  # rank-1 P and Q of each matrix, the biases whole
    for result in run_ranks(_hooks_worker, 2, tmp_path, timeout_s=120):
        powersgd, bf16 = result["powersgd"], result["bf16"]
        assert powersgd["installed"] == "ddp hook powersgd" and bf16["installed"] == "ddp hook bf16"
        # the same gradients as Accelerate's own PowerSGD registration, plain all-reduce first (start_powerSGD_iter 2)
        assert all(step["equal"] for step in powersgd["steps"])
        # 2 ranks: a ring all-reduce sends its input once; fp32 whole for 2 steps, then P, Q and the biases
        assert [step["meter"] for step in powersgd["steps"]] == [{"ddp.powersgd": 4 * n} for n in (params, params, compressed, compressed)]
        assert all(step["meter"]["ddp.powersgd"] == step["recorded"] for step in powersgd["steps"])
        # bf16: the bucket cast to bf16, divided by the world, summed in bf16, cast back
        assert all(step["equal"] for step in bf16["steps"])
        assert all(step["meter"] == {"ddp.bf16_all_reduce": 2 * params} == {"ddp.bf16_all_reduce": step["recorded"]} for step in bf16["steps"])
        # no hook asked on a stock run: DDP's gradients bit for bit, the fp32 bucket's ring all-reduce metered
        stock = result["none"]
        assert stock["installed"] == "ddp hook metered all-reduce" and all(step["equal"] for step in stock["steps"])
        assert all(step["meter"] == {"ddp.all_reduce": 4 * params} == {"ddp.all_reduce": step["recorded"]} for step in stock["steps"])


def _alltoall_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from qaccel import fsdp as qfsdp
    from qaccel.comm import WireMeter
    from qaccel.training.comm_options import CommOptions, install_comm_options
    from tests._collectives import CollectiveRecorder

    def sharded(module: torch.nn.Module) -> torch.nn.Module:
        for layer in module:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=init_device_mesh("cpu", (world,)))
        fully_shard(module, mesh=init_device_mesh("cpu", (world,)))
        return module

    base = _mlp()
    stock = sharded(copy.deepcopy(base))
    fair = sharded(copy.deepcopy(base))
    meter = WireMeter()
    # the QSDP pass-through comms of a --method none run on FSDP2 (both codecs off), as the entry installs them
    handle = qfsdp.install_qsdp(fair, qfsdp.QSDPConfig(weight_bits=None, grad_bits=None, prefetch=False), meter=meter)
    installed = install_comm_options(SimpleNamespace(wire_meter=meter, qsdp=handle), fair, CommOptions(fsdp_reduce_scatter="alltoall"))
    meter.end_step()
    recorder = CollectiveRecorder()
    out: dict = {"installed": installed, "equal": [], "kinds": [], "a2a_meter": [], "a2a_recorded": []}
    for step in range(2):
        stock(_batch(step, rank)).square().mean().backward()
        with recorder.recording():
            fair(_batch(step, rank)).square().mean().backward()
        out["equal"].append(all(torch.equal(a.grad.to_local(), b.grad.to_local()) for a, b in zip(stock.parameters(), fair.parameters(), strict=True)))
        tallies = meter.end_step()
        out["kinds"].append(sorted(tallies))
        out["a2a_meter"].append(tallies["fsdp.alltoall_reduce_scatter"].sent_bytes)
        out["a2a_recorded"].append(recorder.sent_bytes(family="all_to_all"))
        out["reduce_scatter_calls"] = len(recorder.select(family="reduce_scatter"))
        recorder.take()
        for m in (stock, fair):
            m.zero_grad(set_to_none=True)
    dist.barrier()
    return out


def test_fsdp_alltoall_reduce_scatter_gives_stock_fsdp2s_gradients(tmp_path):
    params = sum(p.numel() for p in _mlp().parameters())
    for result in run_ranks(_alltoall_worker, 2, tmp_path, timeout_s=120):
        assert result["installed"] == "fsdp reduce-scatter alltoall"
        # two ranks: the fp32 sum of two chunks and the halving are exact, so gloo's reduce-scatter and ours agree bit for bit
        assert all(result["equal"])
        assert all("fsdp.alltoall_reduce_scatter" in kinds for kinds in result["kinds"])
        # a true reduce-scatter: (P-1)/P of every gradient, once, through all_to_all and nothing through reduce_scatter
        assert result["a2a_meter"] == result["a2a_recorded"] == [4 * params // 2] * 2
        assert result["reduce_scatter_calls"] == 0
