"""Private network namespaces for ``qaccel bench e2e``: one whose loopback is shaped, or a cluster of "nodes".

**One node** (:class:`ShapedNamespace`). The benchmark's ranks talk over ``127.0.0.1`` inside the namespace,
whose only interface is its own ``lo``; no traffic leaves it. Every byte any rank sends crosses that one
device, so both directions (and all ranks) share the shaped rate: a 2-rank exchange at 300 Mbit/s is a shared
300 Mbit/s bus, not two full-duplex 300 Mbit/s links (``BENCHMARKS.md``).

**Several nodes** (:class:`NodeCluster`). Every node is a namespace of its own; its ranks talk to each other
over that namespace's ``lo``, unshaped. The nodes are joined by veth links in ``10.231.0.0/24`` (node ``k`` has
``veth<k>`` with address ``10.231.0.<k+1>``; the range exists only inside these namespaces): two nodes by one
veth pair, more by a veth per node into a bridge in a separate "switch" namespace. Every veth end's egress is
shaped, so each node has ``R`` each way, full duplex, as a NIC on a switch. A rank that sends to a rank of
its own node through the veth *address* (``GLOO_SOCKET_IFNAME=veth<k>``) still goes over ``lo``: Linux
delivers traffic to a local address through the loopback (the ``local`` routing table), so ``lo``'s counters
are the intra-node bytes and the veths' the inter-node bytes.

Shaping: ``tc qdisc replace dev DEV root tbf rate R burst B latency L``. ``burst`` must hold the largest
packet the device emits (loopback's MTU is 64 KiB, and TCP segments of that size are normal on it; a veth
passes GSO segments of that size too), otherwise tbf drops them; it is ``max(256 KiB, 2 ms of R)``: a few
packets' worth, which lets at most 2 ms of traffic pass at memory speed. ``latency`` bounds how long a packet
may wait in the queue, and so sets the queue's length (``R * L + B``); it is 400 ms, enough that a
collective's burst never overflows the queue (a drop costs a 200 ms retransmission timeout), at the price of
queueing delay, which a bulk transfer does not mind. The qdisc's drop counters are recorded next to every
result.

Everything created is removed in ``close()``, which also runs on SIGINT and SIGTERM (turned into exceptions
while the namespaces exist) and kills whatever still runs inside them; deleting a namespace deletes its veth
ends and bridge with it.
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

__all__ = [
    "ShapedNamespace",
    "NodeCluster",
    "NamespaceError",
    "check_prerequisites",
    "tbf_parameters",
    "counter_path",
    "TX_BYTES",
    "MAX_NODES",
]

logger = logging.getLogger(__name__)

TX_BYTES = "/sys/class/net/lo/statistics/tx_bytes"  # read inside the namespace: its own lo
BURST_MIN_BYTES = 256 * 1024
BURST_SECONDS = 0.002
LATENCY_MS = 400
MAX_NODES = 8
CLUSTER_PREFIX = "10.231.0"  # node k: CLUSTER_PREFIX.(k+1)/24, only inside the cluster's namespaces


class NamespaceError(RuntimeError):
    """The namespace could not be created, shaped or used (message says which command and why)."""


def check_prerequisites(euid: int | None = None, what: str = "qaccel bench e2e") -> None:
    """Raise NamespaceError unless this process is root and ``ip`` and ``tc`` exist.

    Args:
        euid: the effective user id to check (default: this process's).
        what: the command that needs the namespace, named in the message (the bench, or ``qaccel demo``).
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


def counter_path(device: str, direction: str = "tx") -> str:
    """The kernel's byte counter of ``device`` (``tx`` or ``rx``), as seen inside the namespace that reads it."""
    return f"/sys/class/net/{device}/statistics/{direction}_bytes"


def _run(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise NamespaceError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


class _Namespaces:
    """Lifecycle shared by the one-node and the cluster set-ups: create, shape devices, kill and delete on exit.

    Subclasses name their namespaces and add devices in :meth:`_build`; ``__exit__`` (or :meth:`close`) kills
    whatever runs in any of them and deletes them all, also after SIGINT/SIGTERM, which raise
    ``KeyboardInterrupt`` while the namespaces exist.
    """

    def __init__(self, names: list[str]) -> None:
        self.names = list(names)
        self.rate_bits: float | None = None
        self._made: list[str] = []
        self._old_handlers: dict[int, object] = {}

    @property
    def created(self) -> bool:
        """Whether any of the namespaces still exists (made here and not yet deleted)."""
        return bool(self._made)

    # -- lifecycle -------------------------------------------------------------------------------------
    def __enter__(self):
        self._install_signal_handlers()
        try:
            for name in self.names:
                if Path("/run/netns", name).exists():
                    raise NamespaceError(f"network namespace {name!r} already exists; remove it with `ip netns del {name}`")
                _run(["ip", "netns", "add", name])
                self._made.append(name)
                _run(["ip", "-n", name, "link", "set", "lo", "up"])
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        """Devices beyond each namespace's loopback (none for a single namespace)."""

    def close(self) -> None:
        """Kill every process left in the namespaces, delete them, restore the signal handlers. Idempotent."""
        try:
            if self._made:
                self._kill_inside()
                for name in list(reversed(self._made)):
                    proc = _run(["ip", "netns", "del", name], check=False)
                    if proc.returncode != 0:
                        logger.error("could not delete network namespace %s: %s", name, proc.stderr.strip())
                    else:
                        self._made.remove(name)
        finally:
            self._restore_signal_handlers()

    def _kill_inside(self) -> None:
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            pids = self.pids()
            if not pids:
                return
            logger.warning("stopping %d process(es) still in %s with %s: %s", len(pids), ", ".join(self._made), sig.name, pids)
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and self.pids():
                time.sleep(0.1)

    def pids(self) -> list[int]:
        """Processes running inside any of the namespaces (``ip netns pids``)."""
        pids: list[int] = []
        for name in self._made:
            proc = _run(["ip", "netns", "pids", name], check=False)
            pids += [int(word) for word in proc.stdout.split() if word.isdigit()]
        return pids

    def exists(self) -> bool:
        """Whether any of the namespaces is listed by ``ip netns list``."""
        listed = {line.split()[0] for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines() if line.strip()}
        return any(name in listed for name in self.names)

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
    def _shaped_devices(self) -> list[tuple[str, str]]:
        """``(namespace, device)`` of every device :meth:`shape` shapes."""
        raise NotImplementedError

    def shape(self, rate_bits: float | None) -> dict | None:
        """Token-bucket every shaped device at ``rate_bits`` bits/s, or remove the shaping (``None``). Returns the tbf settings."""
        if rate_bits is None:
            if self.rate_bits is not None:
                for name, device in self._shaped_devices():
                    _run(["tc", "-n", name, "qdisc", "del", "dev", device, "root"])
            self.rate_bits = None
            return None
        params = tbf_parameters(rate_bits)
        for name, device in self._shaped_devices():
            _run(["tc", "-n", name, "qdisc", "replace", "dev", device, "root", "tbf",
                  "rate", params["rate"], "burst", params["burst"], "latency", params["latency"]])  # fmt: skip
        self.rate_bits = rate_bits
        return params

    def qdisc_stats(self) -> dict:
        """Counters of the root qdisc on the shaped devices (kind, bytes, packets, drops, overlimits, requeues).

        One device: its root qdisc's counters as ``tc`` reports them. Several: the counters summed over them.
        """
        keys = ("kind", "bytes", "packets", "drops", "overlimits", "requeues")
        roots = []
        for name, device in self._shaped_devices():
            proc = _run(["tc", "-n", name, "-s", "-j", "qdisc", "show", "dev", device])
            roots += [{key: entry.get(key) for key in keys} for entry in json.loads(proc.stdout or "[]") if entry.get("root")]
        if len(roots) <= 1:
            return roots[0] if roots else {}
        total: dict = {"kind": ",".join(sorted({str(root["kind"]) for root in roots}))}
        for key in keys[1:]:
            values = [root[key] for root in roots]
            total[key] = sum(values) if all(isinstance(v, int) for v in values) else None
        return total


class ShapedNamespace(_Namespaces):
    """Context manager: ``ip netns add NAME`` with ``lo`` up; :meth:`shape` sets its rate; exit removes it all."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name or f"qaccel-e2e-{os.getpid()}"
        super().__init__([self.name])

    def __enter__(self) -> ShapedNamespace:
        return super().__enter__()

    def _shaped_devices(self) -> list[tuple[str, str]]:
        return [(self.name, "lo")]

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace (there ``/sys/class/net/lo`` is the namespace's loopback)."""
        return ["ip", "netns", "exec", self.name, *argv]


class NodeCluster(_Namespaces):
    """Context manager: ``nodes`` namespaces joined by veth links (module docstring); :meth:`shape` sets the links' rate.

    Node ``k`` is namespace ``<prefix>-node<k>`` with interface :meth:`interface` at :meth:`address`; with more
    than two nodes the bridge lives in ``<prefix>-switch``.
    """

    def __init__(self, nodes: int, prefix: str | None = None) -> None:
        if not 2 <= nodes <= MAX_NODES:
            raise ValueError(f"NodeCluster: nodes={nodes}; allowed: 2 to {MAX_NODES}")
        self.nodes = nodes
        self.prefix = prefix or f"qaccel-e2e-{os.getpid()}"
        self.node_names = [f"{self.prefix}-node{k}" for k in range(nodes)]
        self.switch = f"{self.prefix}-switch" if nodes > 2 else None
        super().__init__(self.node_names + ([self.switch] if self.switch else []))

    def __enter__(self) -> NodeCluster:
        return super().__enter__()

    @staticmethod
    def interface(node: int) -> str:
        """Node ``node``'s inter-node interface (its end of the veth link)."""
        return f"veth{node}"

    @staticmethod
    def address(node: int) -> str:
        """Node ``node``'s address on the inter-node network."""
        return f"{CLUSTER_PREFIX}.{node + 1}"

    @property
    def topology(self) -> str:
        return "veth pair" if self.switch is None else f"{self.nodes} veth links into a bridge in {self.switch}"

    def _build(self) -> None:
        if self.switch is None:
            _run(["ip", "link", "add", self.interface(0), "netns", self.node_names[0], "type", "veth",
                  "peer", "name", self.interface(1), "netns", self.node_names[1]])  # fmt: skip
        else:
            _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
            for k, name in enumerate(self.node_names):
                _run(["ip", "link", "add", self.interface(k), "netns", name, "type", "veth",
                      "peer", "name", f"port{k}", "netns", self.switch])  # fmt: skip
                _run(["ip", "-n", self.switch, "link", "set", f"port{k}", "master", "br0", "up"])
            _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        for k, name in enumerate(self.node_names):
            _run(["ip", "-n", name, "addr", "add", f"{self.address(k)}/24", "dev", self.interface(k)])
            _run(["ip", "-n", name, "link", "set", self.interface(k), "up"])

    def _shaped_devices(self) -> list[tuple[str, str]]:
        devices = [(name, self.interface(k)) for k, name in enumerate(self.node_names)]
        if self.switch is not None:
            devices += [(self.switch, f"port{k}") for k in range(self.nodes)]
        return devices

    def counters(self, node: int) -> dict[str, str]:
        """The counter files a process in node ``node`` reads: ``lo`` (intra-node), the veth's tx and rx (inter-node)."""
        device = self.interface(node)
        return {"lo": counter_path("lo"), "inter_tx": counter_path(device, "tx"), "inter_rx": counter_path(device, "rx")}

    def command(self, node: int, argv: list[str]) -> list[str]:
        """``argv`` run inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.node_names[node], *argv]
