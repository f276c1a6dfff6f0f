"""What the end-to-end tests share: launching a real job (``accelerate launch``, ``torchrun``, ``qaccel
bench e2e``) and reading what it wrote.

Every launch gets :func:`env` (this checkout importable, one thread per rank, no GPU, the Hub offline,
no qaccel/Accelerate/FSDP settings leaking in from the caller) and a free ``MASTER_PORT`` from
:func:`free_port` (bound to port 0, never hard-coded, so tests running side by side do not collide).
A launch that fails raises with the tail of its output.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._dist import launch_env

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "train.py"
QSDP_CONFIG = REPO / "launch_configs" / "cpu_2proc_qsdp.yaml"
DDP_CONFIG = REPO / "launch_configs" / "cpu_2proc_ddp.yaml"
JOB_TIMEOUT_S = 600


def free_port() -> int:
    """A TCP port that nothing listens on now (the OS picks it), for a launcher's ``MASTER_PORT``."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def env(**extra: str) -> dict[str, str]:
    """The environment of a launched job (see ``tests._dist.launch_env``), with ``extra`` on top."""
    return {**launch_env(), **extra}


def failed(proc: subprocess.CompletedProcess) -> str:
    """The assertion message for a job that failed: its exit status and the tails of its output."""
    return f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def run_job(cmd: list[str], *, check: bool = True, cwd: Path = REPO, timeout: float = JOB_TIMEOUT_S, **extra_env: str) -> subprocess.CompletedProcess:
    """Run ``cmd`` under :func:`env`; with ``check``, a non-zero exit fails the test with the job's output."""
    proc = subprocess.run(cmd, env=env(**extra_env), cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, failed(proc)
    return proc


def launch(config: Path, *flags: str, check: bool = True) -> subprocess.CompletedProcess:
    """``accelerate launch --config_file CONFIG scripts/train.py FLAGS``."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--main_process_port", str(free_port()), str(SCRIPT), *flags]
    return run_job(cmd, check=check)


def torchrun_cmd(*args: str, nproc: int = 2) -> list[str]:
    """``torchrun --nproc_per_node NPROC --master_port FREE ARGS`` (``ARGS``: the script or ``-m module``, then its flags)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port()), *args]


def torchrun(*flags: str) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node 2 scripts/train.py FLAGS``; a failure fails the test."""
    return run_job(torchrun_cmd(str(SCRIPT), *flags))


def metrics(out: Path) -> list[dict]:
    """The rows of ``OUT/metrics.jsonl``, one per logged step."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def logged_steps(out: Path) -> int:
    """The last step ``OUT/metrics.jsonl`` records so far (0 before the first); a half-written last line is skipped."""
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    return max((json.loads(line)["step"] for line in lines if line.strip().endswith("}")), default=0)


def wait_for_steps(job: subprocess.Popen, out: Path, steps: int, log: Path, timeout_s: float = 240) -> None:
    """Wait until the running ``job`` has logged ``steps`` steps; fails with the log if it exits or takes too long."""
    deadline = time.monotonic() + timeout_s
    while logged_steps(out) < steps:
        assert job.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, f"the job did not reach step {steps}\n{log.read_text()[-4000:]}"
        time.sleep(0.2)


# -- qaccel bench e2e: network namespaces (root only) ----------------------------------------------------
@functools.cache
def netns_unavailable() -> str | None:
    """Why this machine cannot make network namespaces (not root, no iproute2, not allowed), or None if it can."""
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


def __getattr__(name: str) -> object:
    # ``needs_netns`` probes on first use, so a module that only launches jobs never creates a namespace.
    if name == "needs_netns":
        reason = netns_unavailable()
        return pytest.mark.skipif(reason is not None, reason=str(reason))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def namespaces() -> list[str]:
    """The network namespaces that exist now."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def rebuild_from_raw(cmd: list[str], tmp_path: Path) -> dict[str, dict]:
    """Rerun the bench ``cmd`` with ``--from_raw tmp_path/raw`` (nothing runs, no root needed); its rows by label."""
    rebuilt_json = tmp_path / "rebuilt.json"
    rebuild = cmd[: cmd.index("--json")] + ["--json", str(rebuilt_json), "--from_raw", str(tmp_path / "raw")]
    proc = run_job(rebuild, check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["label"]: r for r in json.loads(rebuilt_json.read_text())["results"]}


def interrupt_once_ranks_run(cmd: list[str], names: list[str], sig: int, ranks: int = 2) -> tuple[int, str, list[str]]:
    """Start the bench, wait until torchrun and its ``ranks`` ranks run in each of the namespaces ``names``,
    send ``sig``; return the exit status, stderr and the processes that were inside."""
    proc = subprocess.Popen(cmd, env=env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    names = [name.format(pid=proc.pid) for name in names]
    try:
        deadline = time.monotonic() + 120
        inside: dict[str, list[str]] = {}
        while time.monotonic() < deadline and proc.poll() is None:
            if set(names) <= set(namespaces()):
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
    assert not set(names) & set(namespaces())
    return proc.returncode, err, [pid for pids in inside.values() for pid in pids]


def gone(pid: str) -> bool:
    """The process has exited (or is a zombie waiting for its parent)."""
    return not Path(f"/proc/{pid}").exists() or "State:\tZ" in Path(f"/proc/{pid}/status").read_text()
