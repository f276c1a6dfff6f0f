"""``qaccel bench e2e``: argument errors, the root check, and a smoke run on a really shaped link.

The smoke and interrupt tests need root and network namespaces (``ip netns add``); elsewhere they are
skipped with the reason. The smoke run checks the link bytes against the kernel's own limits: on a link
shaped to R bit/s a step cannot move its bytes faster than R (up to one token-bucket burst).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qaccel import cli
from qaccel.bench import e2e
from qaccel.bench._e2e_methods import parse_rate
from qaccel.bench._e2e_netns import tbf_parameters
from tests._launch import REPO, env, gone, interrupt_once_ranks_run, namespaces, needs_netns, rebuild_from_raw


# -- arguments and refusals (no root needed) -----------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "bits"),
    [("300mbit", 300e6), ("1gbit", 1e9), ("125mbps", 1e9), ("2mibit", 2 * 1024 * 1024), ("500000", 5e5), ("none", None)],
)
def test_rates_use_tc_units(text, bits):
    assert parse_rate(text) == bits


@pytest.mark.parametrize("bad", ["3xbit", "fast", "0mbit", "10bit"])
def test_bad_bandwidth_is_a_usage_error_naming_it(bad, capsys):
    code = cli.main(["bench", "e2e", "--bandwidth", bad])
    err = capsys.readouterr().err
    assert code == 2
    assert f"bandwidth {bad!r}" in err


def test_unknown_method_is_a_usage_error_listing_the_known_ones(capsys):
    code = cli.main(["bench", "e2e", "--methods", "qsdp-w8g8,fsdp3"])
    err = capsys.readouterr().err
    assert code == 2
    assert "fsdp3" in err and "zero-one-adam" in err and "fsdp2-fp32" in err


def test_warmup_below_two_is_refused(capsys):
    assert cli.main(["bench", "e2e", "--warmup", "1"]) == 2
    assert "must be >= 2" in capsys.readouterr().err


def test_not_root_says_so_and_exits_nonzero_without_creating_anything(monkeypatch, capsys):
    before = namespaces() if shutil.which("ip") else []
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    code = cli.main(["bench", "e2e", "--model", "tiny", "--methods", "ddp-adamw", "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 1
    assert "needs root" in err and "1000" in err
    if shutil.which("ip"):
        assert namespaces() == before


def test_default_plan_runs_prefetch_both_ways_only_for_fsdp2_fp32_and_w8g8():
    configs = e2e.plan_configs(["fsdp2-fp32", "qsdp-w8g8", "qsdp-w4g4", "ddp-adamw"], "default")
    assert configs == [("fsdp2-fp32", False), ("fsdp2-fp32", True), ("qsdp-w8g8", False), ("qsdp-w8g8", True),
                       ("qsdp-w4g4", False), ("ddp-adamw", None)]  # fmt: skip
    assert e2e.plan_configs(["qsdp-w4g4", "zero-one-adam"], "both") == [("qsdp-w4g4", False), ("qsdp-w4g4", True), ("zero-one-adam", None)]


def test_from_raw_names_a_missing_folder(tmp_path):
    cmd = [sys.executable, "-m", "qaccel.cli", "bench", "e2e", "--from_raw", str(tmp_path / "nothing")]
    proc = subprocess.run(cmd, env=env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "--from_raw" in proc.stderr and "not a folder" in proc.stderr


def test_token_bucket_holds_a_full_loopback_packet():
    # lo's MTU is 65536: a burst smaller than one packet makes tbf drop every large segment
    for rate in ("10mbit", "300mbit", "1gbit", "10gbit"):
        params = tbf_parameters(parse_rate(rate))
        assert params["burst_bytes"] >= 2 * 65536
        assert params["rate"] == f"{int(parse_rate(rate))}bit"


# -- on a shaped link (root, network namespaces) --------------------------------------------------------
@needs_netns
def test_smoke_two_ranks_two_methods_on_a_shaped_link(tmp_path):
    out = tmp_path / "e2e.json"
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\nkept text\n")
    cmd = [sys.executable, "-m", "qaccel.cli", "bench", "e2e", "--model", "tiny", "--methods", "fsdp2-fp32,qsdp-w8g8",
           "--prefetch", "off", "--steps", "2", "--bandwidth", "50mbit", "--json", str(out), "--markdown", str(md),
           "--raw_dir", str(tmp_path / "raw")]  # fmt: skip
    proc = subprocess.run(cmd, env=env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    report = json.loads(out.read_text())
    assert {"schema_version", "benchmark", "command", "machine", "settings", "namespace", "shaping", "num_params",
            "compute_only", "results", "goals", "errors", "png", "markdown"} <= set(report)  # fmt: skip
    assert report["errors"] == []
    rows = {r["label"]: r for r in report["results"]}
    assert set(rows) == {"fsdp2-fp32", "qsdp-w8g8"}
    for row in rows.values():
        assert {"step_s", "step_s_min", "step_s_max", "measured_steps", "link_bytes_per_step", "link_bytes_per_rank_step",
                "meter_bytes_per_rank_step", "t_compute_s", "t_comm_s", "ideal_no_overlap_s", "ideal_full_overlap_s",
                "fraction_of_ideal_full_overlap", "speedup", "qdisc"} <= set(row)  # fmt: skip
        assert row["measured_steps"] == 2 and row["bandwidth"] == "50mbit"
        # The kernel's counter is the whole job's traffic: at least what the meter says every rank sent.
        assert row["link_bytes_per_rank_step"] > row["meter_bytes_per_rank_step"] > 0
        # Shaping works: no step moved its bytes faster than 50 Mbit/s (one token bucket of slack).
        burst = report["shaping"]["50mbit"]["burst_bytes"]
        for step in row["steps"]:
            if step["steady"]:
                assert step["seconds"] >= (step["link_bytes"] - burst) * 8 / 50e6
    # QSDP W8G8 puts about a quarter of stock FSDP2's bytes on the link (codes + metadata + raw small params).
    ratio = rows["qsdp-w8g8"]["link_bytes_per_step"] / rows["fsdp2-fp32"]["link_bytes_per_step"]
    assert 0.1 < ratio < 0.5
    assert rows["qsdp-w8g8"]["speedup"]["fsdp2-fp32"] == pytest.approx(rows["fsdp2-fp32"]["step_s"] / rows["qsdp-w8g8"]["step_s"])
    # Everything the run created is gone.
    assert report["namespace"]["removed"] is True
    assert report["namespace"]["name"] not in namespaces()
    assert Path(report["png"]).stat().st_size > 0
    text = md.read_text()
    assert text.startswith("# Benchmarks\n\nkept text\n") and "| qsdp-w8g8 |" in text
    # --from_raw rebuilds the same rows from the kept per-configuration results, without running anything.
    rebuilt = rebuild_from_raw(cmd, tmp_path)
    for label, row in rows.items():
        assert rebuilt[label]["step_s"] == row["step_s"] and rebuilt[label]["link_bytes_per_step"] == row["link_bytes_per_step"]


@needs_netns
def test_ctrl_c_removes_the_namespace_and_its_processes(tmp_path):
    cmd = [sys.executable, "-m", "qaccel.cli", "bench", "e2e", "--model", "tiny", "--methods", "ddp-adamw",
           "--steps", "100000", "--bandwidth", "1mbit", "--json", str(tmp_path / "x.json")]  # fmt: skip
    code, err, inside = interrupt_once_ranks_run(cmd, ["qaccel-e2e-{pid}"], signal.SIGINT)
    assert code == 130, err[-3000:]
    assert "interrupted" in err
    assert all(gone(pid) for pid in inside)


# -- the fair fp32 baseline: an exact all-to-all reduce-scatter (fsdp2-fp32-a2a) ------------------------
def _rank_input(source: int, world: int, chunk: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``source``'s reduce-scatter input: ``world`` chunks of ``chunk`` elements, the same wherever it is built."""
    return torch.randn(world * chunk, generator=torch.Generator().manual_seed(1000 + source)).to(dtype)


def _a2a_reduce_scatter_worker(rank: int, world: int, chunk: int) -> dict:
    import torch.distributed as dist

    from qaccel.comm import WireMeter, alltoall_reduce_scatter

    group = dist.group.WORLD
    sent: list[int] = []
    original = dist.all_to_all_single

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):  # noqa: A002
        sent.append(sum(n for j, n in enumerate(input_split_sizes) if j != dist.get_rank()) * input.element_size())
        return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = counted
    out: dict = {"exact": {}, "errors": []}
    try:
        for dtype in (torch.float32, torch.bfloat16):
            # the plain-torch reference: this rank's slot of every rank's input, summed in fp32 in ascending rank order
            reference = _rank_input(0, world, chunk, dtype)[rank * chunk : (rank + 1) * chunk].float()
            for source in range(1, world):
                reference = reference + _rank_input(source, world, chunk, dtype)[rank * chunk : (rank + 1) * chunk].float()
            for op, expected in ((dist.ReduceOp.SUM, reference), (dist.ReduceOp.AVG, reference / world)):
                for async_op in (False, True):
                    meter = WireMeter()
                    output = torch.empty(chunk, dtype=dtype)
                    work = alltoall_reduce_scatter(output, _rank_input(rank, world, chunk, dtype), group, meter, "rs", op, async_op=async_op)
                    if async_op:
                        work.wait()
                    tally = meter.end_step()["rs"]
                    key = f"{dtype} {op} async={async_op}"
                    out["exact"][key] = torch.equal(output, expected.to(dtype))
                    out.setdefault("meter", []).append((tally.sent_bytes, tally.recv_bytes))
        # refused before anything is sent: an op it cannot honour, a wrong input length
        calls = len(sent)
        for bad in ({"op": dist.ReduceOp.MAX}, {"input": torch.zeros(world * chunk + 1)}):
            try:
                alltoall_reduce_scatter(torch.empty(chunk), bad.get("input", torch.zeros(world * chunk)), group, WireMeter(), "rs", bad.get("op", dist.ReduceOp.SUM))
            except ValueError as exc:
                out["errors"].append(str(exc))
        out["calls_after_refusals"] = len(sent) - calls
    finally:
        dist.all_to_all_single = original
    out["sent"] = sent
    return out


def test_alltoall_reduce_scatter_is_exact_and_sends_a_true_reduce_scatters_bytes(tmp_path):
    from tests._dist import run_ranks

    world, chunk = 3, 1000
    results = run_ranks(_a2a_reduce_scatter_worker, world, tmp_path, chunk, timeout_s=120)
    for rank, result in enumerate(results):
        # bit for bit the plain-torch fp32 sum of the ranks' chunks (ascending rank order), AVG divided by P, sync and async
        assert result["exact"] and all(result["exact"].values()), (rank, result["exact"])
        # (P-1)/P of the input each way, as handed to all_to_all_single, and what the meter recorded
        for (sent_meter, recv_meter), sent_wire, itemsize in zip(result["meter"], result["sent"], [4] * 4 + [2] * 4, strict=True):
            assert sent_wire == (world - 1) * chunk * itemsize == (world - 1) / world * (world * chunk * itemsize)
            assert sent_meter == recv_meter == sent_wire
        assert result["calls_after_refusals"] == 0
        assert "MAX" in result["errors"][0]
        assert "SUM or ReduceOp.AVG" in result["errors"][0]
        assert f"expected {world * chunk}" in result["errors"][1]


def _fair_baseline_fsdp_worker(rank: int, world: int) -> dict:
    """Stock FSDP2 and fsdp2-fp32-a2a's set-up (the entry's ``--method none --fsdp_reduce_scatter alltoall``: QSDP's
    pass-through comms with the all-to-all reduce-scatter) on the same model and data: losses and sharded gradients."""
    import copy
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from qaccel import fsdp as qfsdp
    from qaccel.comm import WireMeter
    from qaccel.training.comm_options import CommOptions, install_comm_options

    torch.manual_seed(0)
    base = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(48, 48), torch.nn.Tanh()) for _ in range(3)])

    class Wrapper(torch.nn.Module):  # sharded as the entry's auto-wrap does a GPT-2: each block, then the root
        def __init__(self, blocks):
            super().__init__()
            self.transformer = torch.nn.Module()
            self.transformer.h = blocks

        def forward(self, x):
            return self.transformer.h(x).square().mean()

    def sharded(model: torch.nn.Module) -> torch.nn.Module:
        for block in model.transformer.h:
            fully_shard(block, mesh=init_device_mesh("cpu", (world,)))
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        return model

    stock = sharded(Wrapper(copy.deepcopy(base)))
    fair = sharded(Wrapper(copy.deepcopy(base)))
    meter = WireMeter()
    handle = qfsdp.install_qsdp(fair, qfsdp.QSDPConfig(weight_bits=None, grad_bits=None, prefetch=False), meter=meter)
    installed = install_comm_options(SimpleNamespace(wire_meter=meter, qsdp=handle), fair, CommOptions(fsdp_reduce_scatter="alltoall"))
    info = {"reduce_scatter": installed}
    calls = []
    original = dist.all_to_all_single
    dist.all_to_all_single = lambda *a, **k: calls.append(1) or original(*a, **k)
    out = {"losses": [], "grads_equal": [], "info": info}
    try:
        for step in range(2):
            x = torch.randn(4, 48, generator=torch.Generator().manual_seed(10 * step + rank))
            losses = []
            for model in (stock, fair):
                loss = model(x)
                loss.backward()
                losses.append(float(loss.detach()))
            out["losses"].append(losses)
            out["grads_equal"].append(all(torch.equal(a.grad.to_local(), b.grad.to_local()) for a, b in zip(stock.parameters(), fair.parameters(), strict=True)))
            for model in (stock, fair):
                model.zero_grad(set_to_none=True)
    finally:
        dist.all_to_all_single = original
    out["all_to_all_calls"] = len(calls)
    out["kinds"] = sorted(meter.end_step())
    return out


def test_fair_baseline_gives_stock_fsdp2s_gradients_through_an_all_to_all(tmp_path):
    from tests._dist import run_ranks

    for result in run_ranks(_fair_baseline_fsdp_worker, 2, tmp_path, timeout_s=120):
        # two ranks: the fp32 sum of two chunks and the halving are exact, so gloo's reduce-scatter and ours agree bit for bit
        assert all(result["grads_equal"]), result
        assert all(a == b for a, b in result["losses"])
        # every unit with parameters (the 3 blocks; the root holds none) reduce-scattered through the all-to-all, twice
        assert result["all_to_all_calls"] == 2 * 3
        assert "fsdp.alltoall_reduce_scatter" in result["kinds"] and result["info"]["reduce_scatter"] == "fsdp reduce-scatter alltoall"


def test_fair_baseline_is_a_default_method_compared_both_ways():
    from qaccel.bench import _e2e_report as report
    from qaccel.bench._e2e_methods import DEFAULT_METHODS

    assert "fsdp2-fp32-a2a" in DEFAULT_METHODS
    assert e2e.plan_configs(["fsdp2-fp32-a2a"], "default") == [("fsdp2-fp32-a2a", False), ("fsdp2-fp32-a2a", True)]
    rows = [
        {"label": label, "method": label.split("+")[0], "prefetch": "+" in label, "bandwidth": "300mbit", "step_s": s,
         "fraction_of_ideal_full_overlap": None}
        for label, s in (("fsdp2-fp32", 8.0), ("fsdp2-fp32-a2a", 6.0), ("qsdp-w8g8", 1.6), ("qsdp-w4g4", 1.0))
    ]  # fmt: skip
    report.add_speedups(rows)
    w8 = rows[2]["speedup"]
    assert w8["fsdp2-fp32"] == pytest.approx(5.0) and w8["fsdp2-fp32-a2a"] == pytest.approx(3.75)
    goals = {g["goal"]: g for g in report.evaluate_goals(rows)}
    assert goals["fsdp2-fp32-a2a / qsdp-w8g8 step time"]["target"] == 4.0
    assert goals["fsdp2-fp32-a2a / qsdp-w8g8 step time"]["met"] is False
    assert goals["fsdp2-fp32-a2a / qsdp-w4g4 step time"] == {**goals["fsdp2-fp32-a2a / qsdp-w4g4 step time"], "value": 6.0, "target": 7.0, "met": False}
