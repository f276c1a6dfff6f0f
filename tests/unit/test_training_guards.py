"""Single-process parts of the training guards and the fault reporter (the multi-rank behaviour is in
tests/dist/test_training_guards.py and tests/e2e/test_train_faults.py)."""

from __future__ import annotations

import datetime
import hashlib
import subprocess
import sys

import psutil
import pytest
import torch
import torch.distributed as dist

from qaccel.training import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    ENV_CHECK_REPLICAS,
    FaultReporter,
    NonFiniteError,
    NonFiniteGuard,
    is_collective_failure,
    replica_check_interval,
)
from qaccel.training.faults import process_group_timeout
from qaccel.training.guards import tensor_digest


def test_replica_check_interval_reads_the_variable_and_names_it_when_bad():
    assert replica_check_interval({}) == 0
    assert replica_check_interval({ENV_CHECK_REPLICAS: " 25 "}) == 25
    assert replica_check_interval({ENV_CHECK_REPLICAS: "0"}) == 0
    for bad in ("-1", "every", "2.5"):
        with pytest.raises(ValueError, match=rf"QACCEL_CHECK_REPLICAS='{bad}': must be an integer >= 0"):
            replica_check_interval({ENV_CHECK_REPLICAS: bad})


def test_tensor_digest_is_the_sha256_of_the_bytes():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    expected = int.from_bytes(hashlib.sha256(t.numpy().tobytes()).digest()[:8], "little", signed=True)
    assert tensor_digest(t) == expected
    assert tensor_digest(t.t().contiguous().t()) == expected  # layout does not matter, values do
    flipped = t.clone()
    flipped.view(torch.int32)[1, 1] ^= 1  # one bit of the mantissa
    assert tensor_digest(flipped) != expected
    assert tensor_digest(t.to(torch.bfloat16)) == int.from_bytes(
        hashlib.sha256(t.to(torch.bfloat16).view(torch.int16).numpy().tobytes()).digest()[:8], "little", signed=True
    )


def _model_with_grads():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model(torch.randn(5, 4)).sum().backward()
    return model


def test_nonfinite_guard_on_one_process():
    model = _model_with_grads()
    assert NonFiniteGuard(model).check(1) is False
    model[1].weight.grad[0, 1] = float("-inf")
    with pytest.raises(NonFiniteError, match=r"step 7: non-finite gradient on rank\(s\) \[0\] of 1, first '1.weight'"):
        NonFiniteGuard(model).check(7)
    # With a scaler an overflowing gradient is a skipped step, not an error ...
    assert NonFiniteGuard(model, scaler=torch.amp.GradScaler("cpu")).check(7) is True
    # ... but a non-finite weight is an error either way, and it is named before any gradient.
    with torch.no_grad():
        model[0].bias[2] = float("nan")
    for scaler in (None, torch.amp.GradScaler("cpu")):
        with pytest.raises(NonFiniteError, match=r"step 8: non-finite weight on rank\(s\) \[0\] of 1, first '0.bias'"):
            NonFiniteGuard(model, scaler=scaler).check(8)


def test_a_huge_but_finite_gradient_is_not_flagged():
    model = _model_with_grads()
    with torch.no_grad():
        model[0].weight.grad.fill_(3e38)  # its 2-norm overflows fp32; the values are finite
    assert NonFiniteGuard(model).check(1) is False


def test_process_group_timeout_validates_before_any_group_exists():
    assert process_group_timeout(DEFAULT_COLLECTIVE_TIMEOUT_S) == datetime.timedelta(seconds=600)
    assert process_group_timeout(2.5) == datetime.timedelta(seconds=2.5)
    for bad in (0, -3, float("nan"), True, "10"):
        with pytest.raises(ValueError, match="--collective_timeout_s .*: must be a number of seconds > 0"):
            process_group_timeout(bad)


def test_is_collective_failure():
    assert is_collective_failure(dist.DistBackendError("NCCL communicator was aborted"))
    assert is_collective_failure(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:25520"))
    assert is_collective_failure(RuntimeError("Timed out waiting 10000ms for recv operation to complete"))
    assert not is_collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_collective_failure(ValueError("gloo"))


def test_fault_reporter_finds_a_dead_local_peer_by_its_pid_file(tmp_path):
    reporter = FaultReporter(tmp_path, 0, 3, install=False)
    reporter.step = 42
    mine = (tmp_path / "pids" / "rank0.pid").read_text().split()
    assert int(mine[0]) == psutil.Process().pid
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        created = psutil.Process(peer.pid).create_time()
        (tmp_path / "pids" / "rank1.pid").write_text(f"{peer.pid} {mine[1]} {created!r}\n")
        (tmp_path / "pids" / "rank2.pid").write_text(f"{peer.pid} {mine[1]} {created - 100!r}\n")  # a reused pid
        assert reporter.lost_ranks() == {2: peer.pid}
        peer.kill()
        peer.wait()
        assert reporter.lost_ranks() == {1: peer.pid, 2: peer.pid}
        (tmp_path / "pids" / "rank2.stopped").touch()  # rank 2 reported and left first: a survivor, not lost
        assert reporter.lost_ranks() == {1: peer.pid}
        (tmp_path / "pids" / "rank2.stopped").unlink()
    finally:
        peer.kill()
        peer.wait()
    line = reporter.describe("collective torch.distributed.all_reduce failed")
    assert line == (
        f"qaccel: rank 0 of 3 stopped at step 42: collective torch.distributed.all_reduce failed; "
        f"lost rank(s) 1 (pid {peer.pid} is gone), 2 (pid {peer.pid} is gone)"
    )
    reporter.close()
    assert not (tmp_path / "pids" / "rank0.pid").exists()
    assert (tmp_path / "pids" / "rank1.pid").exists()  # another rank's file is not ours to remove


def test_fault_reporter_close_restores_the_hooks(tmp_path):
    import signal

    before_hook, before_term = sys.excepthook, signal.getsignal(signal.SIGTERM)
    reporter = FaultReporter(tmp_path, 0, 1)
    assert sys.excepthook != before_hook and signal.getsignal(signal.SIGTERM) != before_term
    reporter.close()
    assert sys.excepthook == before_hook and signal.getsignal(signal.SIGTERM) == before_term
    assert not (tmp_path / "pids").exists()
