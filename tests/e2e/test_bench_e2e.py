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
import time
from pathlib import Path

import pytest

from qaccel import cli
from qaccel.bench import e2e
from qaccel.bench._e2e_methods import parse_rate
from qaccel.bench._e2e_netns import tbf_parameters

REPO = Path(__file__).resolve().parents[2]


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "qaccel bench e2e needs root (network namespace + tc); not root here"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) not installed"
    name = f"qaccel-e2e-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"network namespaces not allowed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


NETNS_SKIP = _netns_unavailable()
needs_netns = pytest.mark.skipif(NETNS_SKIP is not None, reason=str(NETNS_SKIP))


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QACCEL_")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    return env


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
    before = _namespaces() if shutil.which("ip") else []
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    code = cli.main(["bench", "e2e", "--model", "tiny", "--methods", "ddp-adamw", "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 1
    assert "needs root" in err and "1000" in err
    if shutil.which("ip"):
        assert _namespaces() == before


def test_default_plan_runs_prefetch_both_ways_only_for_fsdp2_fp32_and_w8g8():
    configs = e2e.plan_configs(["fsdp2-fp32", "qsdp-w8g8", "qsdp-w4g4", "ddp-adamw"], "default")
    assert configs == [("fsdp2-fp32", False), ("fsdp2-fp32", True), ("qsdp-w8g8", False), ("qsdp-w8g8", True),
                       ("qsdp-w4g4", False), ("ddp-adamw", None)]  # fmt: skip
    assert e2e.plan_configs(["qsdp-w4g4", "zero-one-adam"], "both") == [("qsdp-w4g4", False), ("qsdp-w4g4", True), ("zero-one-adam", None)]


def test_from_raw_names_a_missing_folder(tmp_path):
    cmd = [sys.executable, "-m", "qaccel.cli", "bench", "e2e", "--from_raw", str(tmp_path / "nothing")]
    proc = subprocess.run(cmd, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
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
    proc = subprocess.run(cmd, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
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
    assert report["namespace"]["name"] not in _namespaces()
    assert Path(report["png"]).stat().st_size > 0
    text = md.read_text()
    assert text.startswith("# Benchmarks\n\nkept text\n") and "| qsdp-w8g8 |" in text
    # --from_raw rebuilds the same rows from the kept per-configuration results, without running anything.
    rebuilt = rebuild_from_raw(cmd, tmp_path)
    for label, row in rows.items():
        assert rebuilt[label]["step_s"] == row["step_s"] and rebuilt[label]["link_bytes_per_step"] == row["link_bytes_per_step"]


def rebuild_from_raw(cmd: list[str], tmp_path: Path) -> dict[str, dict]:
    """Rerun ``cmd`` with ``--from_raw tmp_path/raw`` (nothing runs, no root needed); its rows by label."""
    rebuilt_json = tmp_path / "rebuilt.json"
    rebuild = cmd[: cmd.index("--json")] + ["--json", str(rebuilt_json), "--from_raw", str(tmp_path / "raw")]
    proc = subprocess.run(rebuild, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["label"]: r for r in json.loads(rebuilt_json.read_text())["results"]}


def interrupt_once_ranks_run(cmd: list[str], names: list[str], sig: int, ranks: int = 2) -> tuple[int, str, list[str]]:
    """Start the bench, wait until torchrun and its ``ranks`` ranks run in each of the namespaces ``names``,
    send ``sig``; return the exit status, stderr and the processes that were inside."""
    proc = subprocess.Popen(cmd, env=_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    names = [name.format(pid=proc.pid) for name in names]
    try:
        deadline = time.monotonic() + 120
        inside: dict[str, list[str]] = {}
        while time.monotonic() < deadline and proc.poll() is None:
            if set(names) <= set(_namespaces()):
                inside = {n: subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True).stdout.split() for n in names}
                if all(len(pids) >= 1 + ranks for pids in inside.values()):
                    break
            time.sleep(0.5)
        started = inside and all(len(pids) >= 1 + ranks for pids in inside.values())
        assert started, f"the ranks never started in {names}: {inside} {proc.stderr.read() if proc.poll() is not None else ''}"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not set(names) & set(_namespaces())
    return proc.returncode, err, [pid for pids in inside.values() for pid in pids]


def gone(pid: str) -> bool:
    """The process has exited (or is a zombie waiting for its parent)."""
    return not Path(f"/proc/{pid}").exists() or "State:\tZ" in Path(f"/proc/{pid}/status").read_text()


@needs_netns
def test_ctrl_c_removes_the_namespace_and_its_processes(tmp_path):
    cmd = [sys.executable, "-m", "qaccel.cli", "bench", "e2e", "--model", "tiny", "--methods", "ddp-adamw",
           "--steps", "100000", "--bandwidth", "1mbit", "--json", str(tmp_path / "x.json")]  # fmt: skip
    code, err, inside = interrupt_once_ranks_run(cmd, ["qaccel-e2e-{pid}"], signal.SIGINT)
    assert code == 130, err[-3000:]
    assert "interrupted" in err
    assert all(gone(pid) for pid in inside)
