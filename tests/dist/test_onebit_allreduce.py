"""The 1-bit error-feedback all-reduce on real gloo processes against an independent N-worker simulation.

The oracle is ``simulated_compressed_allreduce`` in ``tests/_deepspeed_zoadam_port.py``, a transcription of
DeepSpeed's ``NcclBackend.compressed_allreduce`` maths that runs all N workers in one process. qaccel must
reproduce its output and both error buffers exactly (same float32 operations), on every rank, across
three consecutive calls (so error feedback is exercised), for sizes below 8N, not multiples of 8N, with
exact zeros, and empty tensors, in one batched call and in single-tensor calls, with both paddings.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist

from qaccel.comm import WireMeter, compressed_allreduce, onebit_layout, onebit_wire_bytes
from tests._deepspeed_zoadam_port import simulated_compressed_allreduce
from tests._dist import CollectiveRecorder, run_ranks

SHAPES = [(3, 5), (0,), (40,), (7,), (1,), (64,), (4, 33)]
CALLS = 3


def _inputs(rank: int, call: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * call + rank)
    tensors = [torch.randn(shape, generator=gen) for shape in SHAPES]
    tensors[5][::3] = 0.0  # exact zeros must decode as +scale (DeepSpeed's sign rule)
    return tensors


def _worker(rank, world):
    out = {}
    for padding in ("deepspeed", "minimal"):
        for mode in ("batched", "single"):
            layouts = [onebit_layout(torch.Size(s).numel(), world, padding) for s in SHAPES]
            buffers = [layout.new_error_buffers() for layout in layouts]
            meter, counter = WireMeter(), CollectiveRecorder()
            record = []
            for call in range(CALLS):
                tensors = _inputs(rank, call)
                before = [(w.clone(), s.clone()) for w, s in buffers]
                with counter.recording():
                    if mode == "batched":
                        results = compressed_allreduce(
                            tensors, [w for w, _ in buffers], [s for _, s in buffers], layouts, meter=meter
                        )
                    else:
                        results = [
                            compressed_allreduce([t], [w], [s], [layout], meter=meter)[0]
                            for t, (w, s), layout in zip(tensors, buffers, layouts, strict=True)
                        ]
                gathered = []
                for result in results:
                    peers = [torch.empty_like(result) for _ in range(world)]
                    dist.all_gather(peers, result.contiguous())
                    gathered.append(all(torch.equal(p, peers[0]) for p in peers))
                record.append(
                    {
                        "outputs": results,
                        "errors_before": before,
                        "errors_after": [(w.clone(), s.clone()) for w, s in buffers],
                        "same_on_all_ranks": gathered,
                    }
                )
            out[(padding, mode)] = {"calls": record, "meter": meter.snapshot(), "counted": counter.sent_bytes(),
                                    "collectives": dict(counter.op_counts())}  # fmt: skip
    buffer = io.BytesIO()
    torch.save(out, buffer)
    return buffer.getvalue()


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def allreduce_run(request, tmp_path_factory):
    world = request.param
    payloads = run_ranks(_worker, world, tmp_path_factory.mktemp(f"onebit{world}"), timeout_s=240)
    return world, [torch.load(io.BytesIO(p)) for p in payloads]


@pytest.mark.parametrize("padding", ["deepspeed", "minimal"])
@pytest.mark.parametrize("mode", ["batched", "single"])
def test_matches_simulation_bit_for_bit(allreduce_run, padding, mode):
    world, results = allreduce_run
    for k, shape in enumerate(SHAPES):
        layout = onebit_layout(torch.Size(shape).numel(), world, padding)
        worker_errors = [torch.zeros(layout.padded_numel) for _ in range(world)]
        server_errors = [torch.zeros(layout.server_numel) for _ in range(world)]
        for call in range(CALLS):
            inputs = [_inputs(rank, call)[k] for rank in range(world)]
            if layout.numel:
                expected = simulated_compressed_allreduce(inputs, worker_errors, server_errors)
            else:
                expected = torch.zeros(shape)
            for rank in range(world):
                got = results[rank][(padding, mode)]["calls"][call]
                where = f"tensor {k} {shape}, call {call}, rank {rank}"
                assert got["same_on_all_ranks"][k], where
                assert got["outputs"][k].shape == torch.Size(shape), where
                assert torch.equal(got["outputs"][k], expected), where
                assert torch.equal(got["errors_after"][k][0], worker_errors[rank]), f"{where}: worker error"
                assert torch.equal(got["errors_after"][k][1], server_errors[rank]), f"{where}: server error"


def test_worker_error_feedback_identity(allreduce_run):
    """x + e_old == s_w * (2b - 1) + e_new per element (within one ulp), with b = [x + e_old >= 0]."""
    world, results = allreduce_run
    for rank in range(world):
        for call in range(CALLS):
            got = results[rank][("deepspeed", "batched")]["calls"][call]
            for k, x in enumerate(_inputs(rank, call)):
                if x.numel() == 0:
                    continue
                e_old, e_new = got["errors_before"][k][0], got["errors_after"][k][0]
                compensated = torch.zeros_like(e_old)
                compensated[: x.numel()] = x.reshape(-1)
                compensated += e_old
                scale = torch.linalg.vector_norm(compensated) / compensated.numel() ** 0.5
                decoded = torch.where(compensated >= 0, scale, -scale)
                gap = (compensated - (decoded + e_new)).abs()
                assert torch.all(gap <= torch.finfo(torch.float32).eps * compensated.abs().clamp_min(scale)), (rank, call, k)


@pytest.mark.parametrize("mode", ["batched", "single"])
def test_bytes_recorded_equal_bytes_moved_and_formula(allreduce_run, mode):
    world, results = allreduce_run
    layouts = [onebit_layout(torch.Size(s).numel(), world, "deepspeed") for s in SHAPES]
    if mode == "batched":
        per_call = onebit_wire_bytes(layouts)
    else:
        singles = [onebit_wire_bytes([layout]) for layout in layouts]
        per_call = type(singles[0])(*(sum(getattr(w, f) for w in singles) for f in ("sent_bytes", "recv_bytes", "collectives")))
    # docs/zero_one_adam.md, "Wire format", Bytes: per non-empty tensor, 2 (N-1) M'/(8N) sign bytes + 2 (N-1) 4 scale bytes
    formula = sum(2 * (world - 1) * (lay.padded_numel // (8 * world) + 4) for lay in layouts if lay.numel)
    assert per_call.sent_bytes == per_call.recv_bytes == formula
    for rank in range(world):
        got = results[rank][("deepspeed", mode)]
        snapshot = got["meter"]
        assert snapshot["total_sent_bytes"] == CALLS * formula == got["counted"]
        assert snapshot["total_recv_bytes"] == CALLS * formula
        assert got["collectives"] == {"all_to_all_single": CALLS * per_call.collectives // 2, "all_gather": CALLS * per_call.collectives // 2}
        assert snapshot["total"]["onebit.all_to_all"]["calls"] == CALLS * per_call.collectives // 2


def test_alone_the_call_is_sign_times_rms_of_the_padded_tensor():
    """World size 1 without torch.distributed: worker and server compress the same values, so the result
    is ``||x'|| / sqrt(M') * sign(x)`` with ``x'`` zero-padded to ``M'`` (``x >= 0`` counts as +1)."""
    x = torch.tensor([0.5, -2.0, 0.0, 3.0, -1.0], dtype=torch.float32)
    layout = onebit_layout(x.numel(), 1)
    assert layout.padded_numel == 8
    worker, server = layout.new_error_buffers()
    (out,) = compressed_allreduce([x], [worker], [server], [layout])
    rms = torch.sqrt((x.double() ** 2).sum() / 8)
    expected = (rms * torch.where(x >= 0, 1.0, -1.0).double()).float()
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=0)
