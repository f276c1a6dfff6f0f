"""The fault report under the race a fresh-clone CI run hit: a survivor's collective failed while the
killed peer was still exiting, and it reported "no local peer is gone".

The kernel closes a dying process's sockets before the process becomes a zombie, so a survivor can see
the closed connection while the peer's pid still looks alive. The oracle is a real peer process whose
death (or not) the test controls: killed a moment after the report starts, hung, or a survivor that
reported first.
"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from qaccel.training import faults
from qaccel.training.faults import FaultReporter

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX signals")

NONE_GONE = "no local peer is gone"


def _peer(tmp_path: Path, rank: int) -> subprocess.Popen:
    """A live process recorded as ``rank``'s, as train.py records its ranks."""
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    host = next((tmp_path / "pids").glob("rank*.pid")).read_text().split()[1]  # the reporter's own record
    created = psutil.Process(peer.pid).create_time()
    (tmp_path / "pids" / f"rank{rank}.pid").write_text(f"{peer.pid} {host} {created!r}\n")
    return peer


def test_a_peer_killed_just_after_the_report_starts_is_named_once_it_is_gone(tmp_path):
    reporter = FaultReporter(tmp_path, 0, 2, install=False, peer_exit_wait_s=30)
    peer = _peer(tmp_path, 1)
    try:
        killer = threading.Timer(0.5, peer.kill)  # not reaped: a zombie, as a killed rank is until its launcher waits
        started = time.monotonic()
        killer.start()
        line = reporter.describe("collective torch.distributed.all_reduce failed")
        elapsed = time.monotonic() - started
    finally:
        peer.kill()
        peer.wait()
    assert line.endswith(f"lost rank(s) 1 (pid {peer.pid} is gone)"), line
    assert 0.4 < elapsed < 10, elapsed  # named once confirmed gone, long before the 30 s bound


def test_a_hung_peer_is_reported_as_none_gone_after_the_bounded_wait(tmp_path):
    reporter = FaultReporter(tmp_path, 0, 2, install=False, peer_exit_wait_s=0.5)
    peer = _peer(tmp_path, 1)
    try:
        started = time.monotonic()
        line = reporter.describe("collective torch.distributed.all_reduce failed")
        elapsed = time.monotonic() - started
        assert peer.poll() is None
    finally:
        peer.kill()
        peer.wait()
    assert NONE_GONE in line, line
    assert 0.5 <= elapsed < 5, elapsed


def test_a_peer_that_reported_first_is_not_waited_for(tmp_path):
    reporter = FaultReporter(tmp_path, 0, 2, install=False, peer_exit_wait_s=30)
    peer = _peer(tmp_path, 1)
    (tmp_path / "pids" / "rank1.stopped").touch()
    try:
        started = time.monotonic()
        line = reporter.describe("collective torch.distributed.all_reduce failed")
        elapsed = time.monotonic() - started
    finally:
        peer.kill()
        peer.wait()
    assert NONE_GONE in line and elapsed < 5, (line, elapsed)


_RANK = textwrap.dedent(
    """
    import sys, time
    from qaccel.training.faults import FaultReporter

    reporter = FaultReporter(sys.argv[1], int(sys.argv[2]), 2, peer_exit_wait_s=60)
    print("ready", flush=True)
    time.sleep(120)
    """
)


def test_ranks_stopped_together_by_sigterm_do_not_wait_for_each_other(tmp_path):
    # Each rank marks itself as reporting before it looks at its peers; otherwise both would wait the 60 s.
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK, str(tmp_path), str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        for proc in ranks:
            assert proc.stdout.readline() == "ready\n", proc.stderr.read()
        started = time.monotonic()
        for proc in ranks:
            proc.send_signal(signal.SIGTERM)
        outcomes = [(proc.wait(timeout=45), proc.stderr.read()) for proc in ranks]
        elapsed = time.monotonic() - started
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()
    for rank, (code, err) in enumerate(outcomes):
        assert code == 128 + signal.SIGTERM, err
        assert f"qaccel: rank {rank} of 2 stopped at step 0: stopped by the launcher" in err and NONE_GONE in err, err
    assert elapsed < 30, elapsed


@pytest.mark.parametrize("bad", [-1, True, "5"])
def test_a_bad_wait_is_refused_naming_it(tmp_path, bad):
    with pytest.raises(ValueError, match=r"FaultReporter.peer_exit_wait_s=.*must be a number of seconds >= 0"):
        FaultReporter(tmp_path, 0, 2, install=False, peer_exit_wait_s=bad)


_RECORDED = textwrap.dedent(
    """
    import os, signal, sys, time
    from qaccel.training.faults import FaultReporter

    class Recorder:  # each write call to stderr, as one line of stdout
        def write(self, text):
            os.write(1, (repr(text) + "\\n").encode())
            return len(text)

        def flush(self):
            pass

    reporter = FaultReporter(sys.argv[1], 0, 1, peer_exit_wait_s=0)
    sys.stderr = Recorder()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)  # never reached: the report exits
    """
)


def test_the_report_is_one_write_so_lines_of_ranks_reporting_together_do_not_interleave(tmp_path):
    # Ranks run under `python -u`; print() would write the line and its newline apart, and two survivors
    # reporting at the same moment glued their lines into one (seen in a shake of the fault tests).
    proc = subprocess.run([sys.executable, "-c", _RECORDED, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    writes = [ast.literal_eval(line) for line in proc.stdout.splitlines()]  # reprs of what the child wrote
    assert len(writes) == 1, writes
    assert writes[0].startswith("qaccel: rank 0 of 1 stopped at step 0: stopped by the launcher") and writes[0].endswith("\n"), writes
    assert writes[0].count("\n") == 1, writes


def test_a_survivor_that_reports_and_leaves_during_the_check_is_not_taken_for_the_lost_rank(tmp_path, monkeypatch):
    # The shake's third race: rank 3 read the pid files and markers while survivor 1 still ran; survivor 1
    # then touched its marker, reported and exited before rank 3 checked its pid, so rank 3 named it lost too.
    # The liveness check is where the peer leaves here, deterministically; the victim (rank 2) is gone for real.
    reporter = FaultReporter(tmp_path, 3, 4, install=False, peer_exit_wait_s=30)
    survivor, victim = _peer(tmp_path, 1), _peer(tmp_path, 2)
    victim.kill()
    victim.wait()
    alive = faults._alive

    def survivor_leaves_first(pid: int, created: float) -> bool:
        if pid == survivor.pid and survivor.poll() is None:
            (tmp_path / "pids" / "rank1.stopped").touch()  # what a reporting survivor does before it exits
            survivor.kill()
            survivor.wait()
        return alive(pid, created)

    monkeypatch.setattr(faults, "_alive", survivor_leaves_first)
    try:
        line = reporter.describe("collective torch.distributed.all_reduce failed")
    finally:
        survivor.kill()
        survivor.wait()
    assert line.endswith(f"lost rank(s) 2 (pid {victim.pid} is gone)"), line
