"""A private network namespace whose loopback is shaped with ``tc`` (token bucket), for ``qaccel bench e2e``.

The benchmark's ranks talk over ``127.0.0.1`` inside the namespace, whose only interface is its own ``lo``;
no traffic leaves it. Every byte any rank sends crosses that one device, so both directions (and all ranks)
share the shaped rate: a 2-rank exchange at 300 Mbit/s is a shared 300 Mbit/s bus, not two full-duplex
300 Mbit/s links (``BENCHMARKS.md``).

Shaping: ``tc qdisc replace dev lo root tbf rate R burst B latency L``. ``burst`` must hold the largest
packet the loopback emits (its MTU is 64 KiB, and TCP segments of that size are normal on it), otherwise
tbf drops them; it is ``max(256 KiB, 2 ms of R)``: a few packets' worth, which lets at most 2 ms of traffic
pass at memory speed. ``latency`` bounds how long a packet may wait in the queue, and so sets the queue's
length (``R * L + B``); it is 400 ms, enough that a collective's burst never overflows the queue (a drop
on loopback TCP costs a 200 ms retransmission timeout), at the price of queueing delay, which a bulk
transfer does not mind. The qdisc's drop counters are recorded next to every result.

Everything created is removed in :meth:`ShapedNamespace.close`, which also runs on SIGINT and SIGTERM
(turned into exceptions while the namespace exists) and kills whatever still runs inside it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

__all__ = ["ShapedNamespace", "NamespaceError", "check_prerequisites", "tbf_parameters", "TX_BYTES"]

logger = logging.getLogger(__name__)

TX_BYTES = "/sys/class/net/lo/statistics/tx_bytes"  # read inside the namespace: its own lo
BURST_MIN_BYTES = 256 * 1024
BURST_SECONDS = 0.002
LATENCY_MS = 400


class NamespaceError(RuntimeError):
    """The namespace could not be created, shaped or used (message says which command and why)."""


def check_prerequisites(euid: int | None = None, what: str = "qaccel bench e2e") -> None:
    """Raise NamespaceError unless this process is root and ``ip`` and ``tc`` exist.

    Args:
        euid: the effective user id to check (default: this process's).
        what: the command that needs the namespace, named in the message (the bench, or ``make demo``).
    """
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        raise NamespaceError(
            f"{what} needs root (effective uid {euid}): it creates a network namespace and shapes its "
            f"loopback with tc. Run it as root, e.g. `sudo -E env PATH=$PATH {what} ...`."
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NamespaceError(f"{what} needs {' and '.join(missing)} (iproute2) on PATH; install iproute2")


def tbf_parameters(rate_bits: float) -> dict:
    """``{"rate", "burst", "latency"}`` for ``tc ... tbf`` at ``rate_bits`` bits/s (see the module docstring)."""
    burst = max(BURST_MIN_BYTES, int(rate_bits / 8 * BURST_SECONDS))
    return {"rate": f"{int(rate_bits)}bit", "burst": f"{burst}b", "latency": f"{LATENCY_MS}ms", "burst_bytes": burst}


def _run(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise NamespaceError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


class ShapedNamespace:
    """Context manager: ``ip netns add NAME`` with ``lo`` up; :meth:`shape` sets its rate; exit removes it all."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name or f"qaccel-e2e-{os.getpid()}"
        self.created = False
        self.rate_bits: float | None = None
        self._old_handlers: dict[int, object] = {}

    # -- lifecycle -------------------------------------------------------------------------------------
    def __enter__(self) -> ShapedNamespace:
        self._install_signal_handlers()
        try:
            if Path("/run/netns", self.name).exists():
                raise NamespaceError(f"network namespace {self.name!r} already exists; remove it with `ip netns del {self.name}`")
            _run(["ip", "netns", "add", self.name])
            self.created = True
            _run(["ip", "-n", self.name, "link", "set", "lo", "up"])
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process left in the namespace, delete it, restore the signal handlers. Idempotent."""
        try:
            if self.created:
                self._kill_inside()
                proc = _run(["ip", "netns", "del", self.name], check=False)
                if proc.returncode != 0:
                    logger.error("could not delete network namespace %s: %s", self.name, proc.stderr.strip())
                else:
                    self.created = False
        finally:
            self._restore_signal_handlers()

    def _kill_inside(self) -> None:
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            pids = self.pids()
            if not pids:
                return
            logger.warning("stopping %d process(es) still in %s with %s: %s", len(pids), self.name, sig.name, pids)
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and self.pids():
                time.sleep(0.1)

    def pids(self) -> list[int]:
        """Processes running inside the namespace (``ip netns pids``)."""
        proc = _run(["ip", "netns", "pids", self.name], check=False)
        return [int(word) for word in proc.stdout.split() if word.isdigit()]

    def _install_signal_handlers(self) -> None:
        def handler(signum, frame):  # noqa: ANN001, ARG001
            raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old_handlers[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread: the caller's handlers stay, close() still runs in finally
                pass

    def _restore_signal_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()

    # -- shaping and inspection -------------------------------------------------------------------------
    def shape(self, rate_bits: float | None) -> dict | None:
        """Token-bucket ``lo`` at ``rate_bits`` bits/s, or remove the shaping (``None``). Returns the tbf settings."""
        if rate_bits is None:
            if self.rate_bits is not None:
                _run(["tc", "-n", self.name, "qdisc", "del", "dev", "lo", "root"])
            self.rate_bits = None
            return None
        params = tbf_parameters(rate_bits)
        _run(["tc", "-n", self.name, "qdisc", "replace", "dev", "lo", "root", "tbf",
              "rate", params["rate"], "burst", params["burst"], "latency", params["latency"]])  # fmt: skip
        self.rate_bits = rate_bits
        return params

    def qdisc_stats(self) -> dict:
        """Counters of the root qdisc on ``lo`` (bytes, packets, drops, overlimits, requeues); {} when unshaped."""
        proc = _run(["tc", "-n", self.name, "-s", "-j", "qdisc", "show", "dev", "lo"])
        for entry in json.loads(proc.stdout or "[]"):
            if entry.get("root"):
                return {key: entry.get(key) for key in ("kind", "bytes", "packets", "drops", "overlimits", "requeues")}
        return {}

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace (there ``/sys/class/net/lo`` is the namespace's loopback)."""
        return ["ip", "netns", "exec", self.name, *argv]

    def exists(self) -> bool:
        return self.name in _run(["ip", "netns", "list"], check=False).stdout.split()
