"""What a surviving rank does when a peer dies or a collective fails: one clear line, then a non-zero exit.

When one training process dies (killed, out of memory, a crashed node), the others learn it in one of
three ways: their next collective fails at once (gloo and NCCL see the closed connection), the
launcher (torchrun's elastic agent) sends them SIGTERM, or, when the peer hangs instead of dying,
their collective times out after ``--collective_timeout_s``. Left alone, each of these ends in a
long traceback that does not say which rank is gone, or in silence (SIGTERM). :class:`FaultReporter`
turns all three into one line per surviving rank naming the step, the failed collective and the lost
ranks, then leaves with ``os._exit`` so no interpreter shutdown work can block on the dead peer.

The lost ranks come from pid files: every rank writes ``OUTPUT_DIR/pids/rank{R}.pid`` (pid, host and
process start time) once the process group is up, and a survivor looks up the peers on its own host.
Peers on other hosts are reported as unknown rather than guessed.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import sys
import traceback
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil  # a dependency of Accelerate

__all__ = [
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "EXIT_PEER_FAILURE",
    "FaultReporter",
    "is_collective_failure",
    "process_group_timeout",
]

DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
"""Ten minutes: longer than any single collective of a healthy run (the longest waits are barriers
while rank 0 prepares data or writes a checkpoint), short enough that a hung peer does not hold a GPU
node for PyTorch's 30-minute gloo default."""

EXIT_PEER_FAILURE = 3
"""Exit status of a rank that stopped because a peer or a collective failed."""

_COLLECTIVE_MARKERS = (
    "gloo",
    "nccl",
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "socket",
)


def process_group_timeout(timeout_s: float) -> datetime.timedelta:
    """The process-group timeout for ``InitProcessGroupKwargs``; refuses non-positive values."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"--collective_timeout_s {timeout_s!r}: must be a number of seconds > 0")
    return datetime.timedelta(seconds=float(timeout_s))


def is_collective_failure(err: BaseException) -> bool:
    """Whether ``err`` is a failed or timed-out collective (as opposed to a bug in the training code)."""
    import torch.distributed as dist

    if isinstance(err, dist.DistError):
        return True
    if not isinstance(err, RuntimeError):
        return False
    text = str(err).lower()
    return any(marker in text for marker in _COLLECTIVE_MARKERS)


def _collective_name(tb: TracebackType | None) -> str | None:
    """The ``torch.distributed`` function the error came out of (``all_reduce``, ``all_gather_single``, ...)."""
    from ..comm import DecodeOnWait

    name = None
    for frame, _ in traceback.walk_tb(tb):
        if frame.f_code.co_filename.endswith("distributed_c10d.py") and not frame.f_code.co_name.startswith("_"):
            name = frame.f_code.co_name
        elif frame.f_code.co_name == "wait" and isinstance(frame.f_locals.get("self"), DecodeOnWait):
            # An asynchronous (prefetched) collective fails where it is waited on, not where it started.
            name = frame.f_locals["self"].collective
    return name


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = lines[0] if lines else type(err).__name__
    return text if len(text) <= 300 else text[:297] + "..."


class FaultReporter:
    """Reports a lost peer or failed collective on this rank as one line and exits non-zero.

    Create it right after the Accelerator (the process group is up), set :attr:`step` to the step in
    progress as training goes, and call :meth:`close` at a clean end. While installed it owns
    ``sys.excepthook`` (a collective failure escaping ``main`` is reported, anything else keeps the
    normal traceback) and the SIGTERM handler (the launcher stopping this rank because another died).
    """

    def __init__(self, output_dir: str | os.PathLike, rank: int, world_size: int, *, install: bool = True) -> None:
        self.rank = rank
        self.world_size = world_size
        self.step = 0
        self.pid_dir = Path(output_dir) / "pids"
        self.pid_dir.mkdir(parents=True, exist_ok=True)
        self.pid_file = self.pid_dir / f"rank{rank}.pid"
        self.stopped_file = self.pid_dir / f"rank{rank}.stopped"
        self.stopped_file.unlink(missing_ok=True)  # left by an earlier run in this output dir
        me = psutil.Process()
        self.pid_file.write_text(f"{me.pid} {socket.gethostname()} {me.create_time()!r}\n")
        self._installed = False
        self._previous_hook = sys.excepthook
        self._previous_sigterm: Any = None
        if install:
            sys.excepthook = self._excepthook
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True

    # ------------------------------------------------------------------------------- peers
    def lost_ranks(self) -> dict[int, int]:
        """Peers on this host whose recorded process is gone (or a zombie): ``{rank: pid}``.

        A peer that stopped through its own report (it left ``rank{R}.stopped``) is a survivor that
        went first, not a lost rank.
        """
        host = socket.gethostname()
        lost = {}
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            try:
                pid_text, pid_host, created = (self.pid_dir / f"rank{rank}.pid").read_text().split()
            except (OSError, ValueError):
                continue  # not written yet, or a rank on another host with no shared output dir
            if pid_host != host or (self.pid_dir / f"rank{rank}.stopped").exists():
                continue
            if not _alive(int(pid_text), float(created)):
                lost[rank] = int(pid_text)
        return lost

    def describe(self, cause: str) -> str:
        """The one line this rank prints: rank, step, cause and the lost ranks."""
        lost = self.lost_ranks()
        if lost:
            peers = "lost rank(s) " + ", ".join(f"{r} (pid {pid} is gone)" for r, pid in sorted(lost.items()))
        else:
            peers = "no local peer is gone (a rank on another host, or a hung rank that hit the timeout)"
        return f"qaccel: rank {self.rank} of {self.world_size} stopped at step {self.step}: {cause}; {peers}"

    # ------------------------------------------------------------------------------- exits
    def _report_and_exit(self, line: str, status: int) -> None:
        try:
            self.stopped_file.touch()
        except OSError:
            pass  # the report matters more than the marker
        sys.stdout.flush()
        print(line, file=sys.stderr, flush=True)
        os._exit(status)  # skip interpreter shutdown: destructors may wait on the dead peer

    def _excepthook(self, kind: type[BaseException], err: BaseException, tb: TracebackType | None) -> None:
        import torch.distributed as dist

        if is_collective_failure(err) or (isinstance(err, Exception) and self.lost_ranks()):
            if not isinstance(err, dist.DistError):  # matched by its text: keep the evidence
                traceback.print_exception(kind, err, tb, limit=-3, file=sys.stderr)
            where = _collective_name(tb)
            what = f"collective torch.distributed.{where} failed" if where else "collective failed"
            self._report_and_exit(self.describe(f"{what} ({type(err).__name__}: {_first_line(err)})"), EXIT_PEER_FAILURE)
        self._previous_hook(kind, err, tb)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        cause = "stopped by the launcher (SIGTERM: another rank failed, or the job was interrupted)"
        self._report_and_exit(self.describe(cause), 128 + signum)

    def close(self) -> None:
        """A clean end: restore the hooks and remove this rank's pid file (and the folder once empty)."""
        if self._installed:
            sys.excepthook = self._previous_hook
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._installed = False
        self.pid_file.unlink(missing_ok=True)
        try:
            self.pid_dir.rmdir()
        except OSError:
            pass  # other ranks' files are still there; the last rank to finish removes it


def _alive(pid: int, created: float) -> bool:
    """The process ``pid`` that started at ``created`` still runs (a reused pid or a zombie does not count)."""
    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - created) < 1e-3 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
