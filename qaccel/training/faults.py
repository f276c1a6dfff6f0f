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
Peers on other hosts are reported as unknown rather than guessed. A survivor can learn of the failure
before the killed peer is gone: the kernel closes a dying process's sockets before it becomes a zombie,
so the closed connection may arrive while the peer still looks alive. A survivor therefore waits, up
to ``peer_exit_wait_s``, for a local peer to be confirmed gone before it says none is.

Ctrl-C is not a fault: :class:`InterruptHandler` makes every rank leave quietly with status 130, the
main process printing one line (the step, the last complete checkpoint, the command that resumes),
with no pid file or half-written checkpoint left behind. ``qaccel train`` passes that command to the
ranks it launches in :data:`RESUME_COMMAND_ENV`.
"""

from __future__ import annotations

import datetime
import os
import shlex
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, NoReturn

import psutil  # a dependency of Accelerate

__all__ = [
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "EXIT_INTERRUPTED",
    "EXIT_PEER_FAILURE",
    "PEER_EXIT_WAIT_S",
    "RESUME_COMMAND_ENV",
    "FaultReporter",
    "InterruptHandler",
    "interrupt_line",
    "resume_argv",
    "is_collective_failure",
    "process_group_timeout",
]

DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
"""Ten minutes: longer than any single collective of a healthy run (the longest waits are barriers
while rank 0 prepares data or writes a checkpoint), short enough that a hung peer does not hold a GPU
node for PyTorch's 30-minute gloo default."""

EXIT_PEER_FAILURE = 3
"""Exit status of a rank that stopped because a peer or a collective failed."""

EXIT_INTERRUPTED = 130
"""Exit status of a run stopped by Ctrl-C (SIGINT): 128 + 2, what a shell reports for it."""

PEER_EXIT_WAIT_S = 5.0
"""How long a reporting rank waits for a local peer to be confirmed gone before it reports that none is.
A SIGKILLed training process takes well under a second to become a zombie even on a loaded machine
(a fresh-clone CI run saw a survivor check 0.6 s after the kill, too early); only a hung peer, which
never goes, costs the whole wait, on top of the collective timeout it already cost."""

RESUME_COMMAND_ENV = "QACCEL_RESUME_COMMAND"
"""Set by ``qaccel train`` for the ranks it launches: the command line that resumes the run."""

_RESUME_FLAGS = ("--resume_from_checkpoint", "--resume-from-checkpoint")

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
    ``peer_exit_wait_s`` bounds how long a report waits for a dying local peer to be gone (see
    :meth:`describe`).
    """

    def __init__(
        self, output_dir: str | os.PathLike, rank: int, world_size: int, *, install: bool = True, peer_exit_wait_s: float = PEER_EXIT_WAIT_S
    ) -> None:
        if isinstance(peer_exit_wait_s, bool) or not isinstance(peer_exit_wait_s, (int, float)) or not peer_exit_wait_s >= 0:
            raise ValueError(f"FaultReporter.peer_exit_wait_s={peer_exit_wait_s!r}: must be a number of seconds >= 0")
        self.rank = rank
        self.world_size = world_size
        self.step = 0
        self.peer_exit_wait_s = float(peer_exit_wait_s)
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
    def _local_peers(self) -> dict[int, tuple[int, float]]:
        """Peers on this host that have not reported: ``{rank: (pid, process start time)}`` from their pid files.

        A peer that stopped through its own report (it left ``rank{R}.stopped``) is a survivor that
        went first, not a candidate for a lost rank.
        """
        host = socket.gethostname()
        peers = {}
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            try:
                pid_text, pid_host, created = (self.pid_dir / f"rank{rank}.pid").read_text().split()
            except (OSError, ValueError):
                continue  # not written yet, or a rank on another host with no shared output dir
            if pid_host == host and not (self.pid_dir / f"rank{rank}.stopped").exists():
                peers[rank] = (int(pid_text), float(created))
        return peers

    def lost_ranks(self) -> dict[int, int]:
        """Peers on this host whose recorded process is gone (or a zombie): ``{rank: pid}``.

        A peer that stopped through its own report (it left ``rank{R}.stopped``) is a survivor that
        went first, not a lost rank.
        """
        return self.await_lost_ranks(0.0)

    def await_lost_ranks(self, wait_s: float) -> dict[int, int]:
        """:meth:`lost_ranks`, waiting up to ``wait_s`` seconds while none is lost yet and a local peer still runs.

        Returns as soon as a peer is confirmed gone, or once every local peer has reported (left its
        ``rank{R}.stopped``: ranks stopped together, by one SIGTERM, do not wait for each other).
        """
        deadline = time.monotonic() + wait_s
        while True:
            peers = self._local_peers()
            gone = {rank: pid for rank, (pid, created) in peers.items() if not _alive(pid, created)}
            # A survivor touches its marker before it reports and exits, so markers read after the liveness
            # check tell a survivor that left since the pid files were read (seen in a shake run) from a lost rank.
            lost = {rank: pid for rank, pid in gone.items() if not (self.pid_dir / f"rank{rank}.stopped").exists()}
            if gone != lost:
                continue  # a survivor left: look again without it
            if lost or not peers or time.monotonic() >= deadline:
                return lost
            time.sleep(0.05)

    def describe(self, cause: str) -> str:
        """The one line this rank prints: rank, step, cause and the lost ranks.

        Waits (up to :attr:`peer_exit_wait_s`) for a local peer to be confirmed gone before it reports
        that none is: the closed connection that failed this rank's collective can arrive while the
        killed peer is still exiting.
        """
        lost = self.await_lost_ranks(self.peer_exit_wait_s)
        if lost:
            peers = "lost rank(s) " + ", ".join(f"{r} (pid {pid} is gone)" for r, pid in sorted(lost.items()))
        else:
            peers = "no local peer is gone (a rank on another host, or a hung rank that hit the timeout)"
        return f"qaccel: rank {self.rank} of {self.world_size} stopped at step {self.step}: {cause}; {peers}"

    # ------------------------------------------------------------------------------- exits
    def _report_and_exit(self, cause: str, status: int) -> None:
        try:
            # Before describing: a peer reporting at the same time then knows this rank is a survivor
            # and does not wait for it to go.
            self.stopped_file.touch()
        except OSError:
            pass  # the report matters more than the marker
        line = self.describe(cause)
        sys.stdout.flush()
        # One write, line and newline together: ranks run unbuffered (torchrun's `python -u`), where print()
        # writes the two apart, and two survivors reporting at once glued their lines (seen in a shake run).
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        os._exit(status)  # skip interpreter shutdown: destructors may wait on the dead peer

    def _excepthook(self, kind: type[BaseException], err: BaseException, tb: TracebackType | None) -> None:
        import torch.distributed as dist

        if is_collective_failure(err) or (isinstance(err, Exception) and self.lost_ranks()):
            if not isinstance(err, dist.DistError):  # matched by its text: keep the evidence
                traceback.print_exception(kind, err, tb, limit=-3, file=sys.stderr)
            where = _collective_name(tb)
            what = f"collective torch.distributed.{where} failed" if where else "collective failed"
            self._report_and_exit(f"{what} ({type(err).__name__}: {_first_line(err)})", EXIT_PEER_FAILURE)
        self._previous_hook(kind, err, tb)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        cause = "stopped by the launcher (SIGTERM: another rank failed, or the job was interrupted)"
        self._report_and_exit(cause, 128 + signum)

    def close(self) -> None:
        """A clean end: restore the hooks and remove this rank's pid file (and the folder once empty)."""
        if self._installed:
            sys.excepthook = self._previous_hook
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._installed = False
        self.remove_files()

    def remove_files(self) -> None:
        """Remove this rank's pid file and stop marker, and the ``pids/`` folder once it is empty."""
        self.pid_file.unlink(missing_ok=True)
        self.stopped_file.unlink(missing_ok=True)
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


def resume_argv(argv: list[str]) -> list[str]:
    """``argv`` with ``--resume_from_checkpoint latest`` in place of any ``--resume_from_checkpoint`` it had."""
    kept: list[str] = []
    skip_value = False
    for arg in argv:
        if skip_value:
            skip_value = False
        elif arg in _RESUME_FLAGS:
            skip_value = True
        elif not arg.startswith(tuple(flag + "=" for flag in _RESUME_FLAGS)):
            kept.append(arg)
    return [*kept, "--resume_from_checkpoint", "latest"]


def interrupt_line(where: str, output_dir: str | os.PathLike | None, resume_command: str) -> str:
    """The one line of an interrupted run: ``qaccel: interrupted WHERE; CHECKPOINT; resume with: COMMAND``.

    ``--resume_from_checkpoint latest`` starts afresh when there is no complete checkpoint yet, so
    the same command serves both cases.
    """
    from ..checkpoint import latest_checkpoint

    latest = latest_checkpoint(output_dir) if output_dir is not None else None
    saved = f"the last complete checkpoint is {latest}" if latest else "no complete checkpoint yet"
    return f"qaccel: interrupted {where}; {saved}; resume with: {resume_command}"


class InterruptHandler:
    """Ctrl-C (SIGINT) on a training process: one line from the main process, nothing left behind, exit 130.

    ``accelerate launch`` and ``torchrun`` pass a Ctrl-C on to every rank as SIGINT; left alone, each
    printed a ``KeyboardInterrupt`` traceback and left its pid file. While installed (a context
    manager), SIGINT runs :meth:`finish` at the next bytecode: it ignores further SIGINT and SIGTERM
    (the launcher follows up with SIGTERM), the main process deletes the hidden partial checkpoint
    folders and prints the line, every rank removes its pid file, and the process leaves with
    ``os._exit(130)``. The stack is not unwound: ``finally`` blocks and context exits would run
    collectives (Accelerate's ``main_process_first`` barrier) with peers that are already leaving.

    Args:
        is_main: whether this is the main process (global rank 0), which prints the line.
        argv: the training entry point's arguments, for the resume command when no launcher gave one.
        output_dir: the run's output folder, once known (set :attr:`output_dir` later otherwise).
    """

    def __init__(self, *, is_main: bool, argv: list[str], output_dir: str | os.PathLike | None = None) -> None:
        self.is_main = is_main
        self.argv = list(argv)
        self.output_dir = Path(output_dir) if output_dir is not None else None
        #: the rank's FaultReporter once the process group is up: its step and pid file
        self.reporter: FaultReporter | None = None
        self._previous: Any = None

    def __enter__(self) -> InterruptHandler:
        self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)

    def resume_command(self) -> str:
        """What to run to resume: the launcher's command (:data:`RESUME_COMMAND_ENV`), else this entry point's."""
        given = os.environ.get(RESUME_COMMAND_ENV, "").strip()
        if given:
            return given
        return "your launcher (torchrun, accelerate launch) with " + shlex.join(["-m", "qaccel.train", *resume_argv(self.argv)])

    def describe(self) -> str:
        """The line the main process prints."""
        step = self.reporter.step if self.reporter is not None else 0
        where = f"at step {step}" if step else "before the first training step"
        return interrupt_line(where, self.output_dir, self.resume_command())

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        self.finish()

    def finish(self) -> NoReturn:
        """Clean up, print the line (main process), and exit with status 130."""
        from ..checkpoint import remove_partial_checkpoints

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        try:
            if self.is_main and self.output_dir is not None:
                remove_partial_checkpoints(self.output_dir)
            if self.is_main:
                try:
                    sys.stdout.flush()
                except (OSError, ValueError):
                    pass  # a closed or broken stdout must not cost the line on stderr
                # On a line of its own: a progress bar on stderr leaves the cursor at the end of its line.
                print("\n" + self.describe(), file=sys.stderr, flush=True)
            if self.reporter is not None:
                self.reporter.remove_files()
        finally:
            os._exit(EXIT_INTERRUPTED)  # skip interpreter shutdown: destructors may wait on peers that left
