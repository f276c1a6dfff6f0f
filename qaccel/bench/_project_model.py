"""The step-time model of ``qaccel bench project``: compute plus the exposed part of every collective.

For one optimizer step of a method on a platform (``BENCHMARKS.md``, "Beyond two nodes: projected")::

    t(c)  = max over links l of  bytes_l(c) / rate_l  +  steps(c) * latency     one collective
    L_l   = sum over c of count(c) * bytes_l(c) / rate_l                          busy time of link l
    C     = max over links of L_l                                                 links run in parallel
    E     = sum of t(c) over the step's edge collectives                          never hidden
    A     = T_compute + K + H                                                     the compute side
    T     = A + C - alpha * min(A, max(0, C - E))

* ``K``, codec time: elements quantized / quantize rate + elements dequantized / dequantize rate, per
  rank, times ``ranks per machine / cores`` when ranks share cores (the simulated cluster).
* ``H``, host transport time: what moving bytes through the kernel's TCP stack costs the cores that also
  compute, on the simulated cluster: ``sum over links of h_l * (bytes all ranks send over link l)``,
  with one ``h`` for shaped links (token-bucket pacing included) and one for the unshaped loopbacks;
  0 on GPUs.
* Edge collectives: the first unit's all-gather of every micro-batch (nothing can run before it) and
  the last unit's reduce-scatter and replica all-reduce (nothing is left to run after them). The root
  unit is both: FSDP2 gathers it first and reduces it last. Without explicit prefetch every unit's
  forward all-gather is an edge too: FSDP2 issues it when the unit is reached, and on a CPU nothing
  runs ahead to issue it earlier (backward all-gathers are prefetched by FSDP2 itself).
* ``alpha``, overlap efficiency: 1 hides every non-edge collective behind compute (``T = max(A + E, C)``
  when they fit), 0 hides nothing (``T = A + C``).

Links: ``bus`` (one medium shared by all ranks of a node in both directions: the simulated node's
loopback), ``port`` (a switched full-duplex port per rank: NVLink), ``nic`` (one link per node and
direction to the other nodes: the simulated veth pair, an Ethernet NIC). An unshaped loopback has no
rate of its own: its cost is the host transport time ``H``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ._project_bytes import Collective

__all__ = [
    "Link",
    "CodecRates",
    "Platform",
    "StepTime",
    "CalibrationCase",
    "step_time",
    "collective_seconds",
    "predict_case",
    "fit_calibration",
    "Fit",
    "LINK_KINDS",
]

LINK_KINDS = ("bus", "port", "nic")


@dataclass(frozen=True)
class Link:
    """One level of the network.

    Attributes:
        kind: ``bus``, ``port`` or ``nic`` (module docstring).
        rate_bytes_per_s: bytes per second; ``None``: unshaped, no cost beyond the host's.
        latency_s: seconds per step of a collective that crosses it (ring: P-1 steps per pass).
        host_s_per_byte: ``h`` of the link: host time per byte sent over it, serial with compute.
    """

    kind: str
    rate_bytes_per_s: float | None
    latency_s: float = 0.0
    host_s_per_byte: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in LINK_KINDS:
            raise ValueError(f"Link.kind={self.kind!r}: must be one of {', '.join(LINK_KINDS)}")
        if self.rate_bytes_per_s is not None and not self.rate_bytes_per_s > 0:
            raise ValueError(f"Link.rate_bytes_per_s={self.rate_bytes_per_s!r}: must be > 0 or None (unshaped)")

    def bytes_of(self, collective: Collective) -> float:
        traffic = collective.traffic
        return {"bus": traffic.intra_bus, "port": traffic.intra_port, "nic": traffic.inter_nic}[self.kind]

    def seconds(self, nbytes: float) -> float:
        return 0.0 if self.rate_bytes_per_s is None else nbytes / self.rate_bytes_per_s


@dataclass(frozen=True)
class CodecRates:
    """Seconds per element of quantize and dequantize, by code width (from ``qaccel bench quant``).

    A width that was not measured uses the nearest measured one (the codec's cost is dominated by
    reading and writing the elements, not by the width).
    """

    quantize_s: dict[int, float]
    dequantize_s: dict[int, float]
    source: str = ""

    def seconds(self, encode: dict[int, float], decode: dict[int, float]) -> float:
        return sum(n * _nearest(self.quantize_s, bits) for bits, n in encode.items()) + sum(
            n * _nearest(self.dequantize_s, bits) for bits, n in decode.items()
        )


def _nearest(table: dict[int, float], bits: int) -> float:
    if not table:
        raise ValueError("CodecRates: no measured code width")
    return table[min(table, key=lambda b: (abs(b - bits), b))]


@dataclass(frozen=True)
class Platform:
    """Where a step runs: links, codec speed, host transport cost and overlap efficiency.

    Attributes:
        intra: the link between ranks of one node.
        inter: the link between nodes (``None`` on one node).
        codec: codec throughput.
        codec_share: how many ranks share one core's codec work (``max(1, ranks / cores)``).
        overlap: ``alpha`` with and without explicit prefetch.
    """

    intra: Link
    inter: Link | None
    codec: CodecRates
    codec_share: float = 1.0
    overlap: dict[bool, float] = field(default_factory=lambda: {True: 1.0, False: 1.0})

    def links(self) -> list[Link]:
        return [self.intra] + ([self.inter] if self.inter is not None else [])


@dataclass(frozen=True)
class StepTime:
    """The terms of one predicted step (seconds; bytes per step)."""

    total_s: float
    compute_s: float
    codec_s: float
    host_s: float
    comm_s: float
    edge_s: float
    link_busy_s: dict[str, float]
    bytes_per_step: dict[str, float]

    @property
    def ideal_full_overlap_s(self) -> float:
        """``max(T_compute, T_comm)``, the simulated bench's full-overlap ideal."""
        return max(self.compute_s, self.comm_s)


def collective_seconds(collective: Collective, platform: Platform) -> float:
    """``t(c)``: the slowest link's transfer time plus the latency of its steps when it crosses nodes."""
    seconds = max(link.seconds(link.bytes_of(collective)) for link in platform.links())
    if platform.inter is not None and collective.traffic.inter_nic > 0:
        seconds += collective.steps * platform.inter.latency_s
    return seconds


def step_time(
    collectives: Sequence[Collective],
    platform: Platform,
    *,
    compute_s: float,
    prefetch: bool,
    micro_batches: int = 1,
) -> StepTime:
    """Predicted time of one optimizer step (the module docstring's equations)."""
    if compute_s < 0 or not math.isfinite(compute_s):
        raise ValueError(f"step_time: compute_s={compute_s!r} must be a finite number >= 0")
    busy: dict[str, float] = {}
    level_bytes = {"intra_node": 0.0, "inter_node": 0.0, "sent_per_rank": 0.0, "machine": 0.0, "machine_inter": 0.0}
    codec = host = edge = 0.0
    for c in collectives:
        for name, link in (("intra_node", platform.intra), ("inter_node", platform.inter)):
            if link is None:
                continue
            nbytes = link.bytes_of(c) * c.count
            busy[name] = busy.get(name, 0.0) + link.seconds(nbytes)
            if link is platform.inter and c.traffic.inter_nic > 0:
                busy[name] += c.count * c.steps * link.latency_s
        level_bytes["intra_node"] += c.count * (
            c.traffic.intra_bus if platform.intra.kind == "bus" else c.traffic.intra_port
        )
        level_bytes["inter_node"] += c.count * c.traffic.inter_nic
        level_bytes["sent_per_rank"] += c.count * c.traffic.sent_per_rank
        level_bytes["machine"] += c.count * c.traffic.machine
        level_bytes["machine_inter"] += c.count * c.traffic.machine_inter
        host += c.count * platform.intra.host_s_per_byte * (c.traffic.machine - c.traffic.machine_inter)
        if platform.inter is not None:
            host += c.count * platform.inter.host_s_per_byte * c.traffic.machine_inter
        codec += c.count * platform.codec.seconds(c.encode, c.decode)
        if c.phase == "all_gather" and (c.root or not prefetch):
            edge += micro_batches * collective_seconds(c, platform)  # its forward all-gather, every micro-batch
        elif c.root:
            edge += collective_seconds(c, platform)
    comm = max(busy.values()) if busy else 0.0
    codec *= platform.codec_share
    a = compute_s + codec + host
    alpha = platform.overlap[bool(prefetch)]
    total = a + comm - alpha * min(a, max(0.0, comm - edge))
    return StepTime(total, compute_s, codec, host, comm, min(edge, comm), busy, level_bytes)


@dataclass(frozen=True)
class CalibrationCase:
    """One measured configuration, reduced to the terms that do not depend on the fitted ``h`` and ``alpha``."""

    compute_s: float  # T_compute + K
    shaped_bytes: float  # bytes all ranks send over shaped links per step (h_shaped applies)
    unshaped_bytes: float  # ... over unshaped loopbacks (h_unshaped applies)
    comm_s: float
    edge_s: float
    prefetch: bool
    measured_s: float


def predict_case(case: CalibrationCase, h_shaped: float, h_unshaped: float, alpha: float) -> float:
    """``T`` of the module docstring for one case at the given ``h`` and ``alpha`` (what the fit evaluates)."""
    a = case.compute_s + h_shaped * case.shaped_bytes + h_unshaped * case.unshaped_bytes
    return a + case.comm_s - alpha * min(a, max(0.0, case.comm_s - case.edge_s))


@dataclass(frozen=True)
class Fit:
    """What :func:`fit_calibration` found: the host costs, ``alpha`` per prefetch setting, the rms log error.

    ``h_unshaped`` is ``None`` when no case sent a byte over an unshaped link (nothing to fit it on).
    """

    h_shaped: float
    h_unshaped: float | None
    alpha: dict[bool, float]
    rms_log_error: float

    def predict(self, case: CalibrationCase) -> float:
        return predict_case(case, self.h_shaped, self.h_unshaped or 0.0, self.alpha[case.prefetch])


def _columns(cases: Sequence[CalibrationCase]):
    """``column(name)``: that field of every case as an array along the last of four axes."""
    return lambda name: np.array([getattr(c, name) for c in cases])[None, None, None, :]


def fit_calibration(cases: Sequence[CalibrationCase], *, h_grid: Sequence[float], alpha_grid: Sequence[float]) -> Fit:
    """Least squares on log(predicted / measured) over a grid of ``h_shaped`` x ``h_unshaped`` x ``alpha``.

    ``alpha`` is fitted per prefetch setting (the two overlap differently); both ``h`` are shared. A
    prefetch setting without cases gets the other's ``alpha`` (1 when there are none).
    """
    if not cases:
        raise ValueError("fit_calibration: no measured configuration to fit")
    grid = np.asarray(h_grid, dtype=float)
    unshaped_seen = any(c.unshaped_bytes > 0 for c in cases)
    hs = grid[:, None, None, None]
    hu = (grid if unshaped_seen else np.zeros(1))[None, :, None, None]
    alpha = np.asarray(alpha_grid, dtype=float)[None, None, :, None]
    score = np.zeros((hs.shape[0], hu.shape[1]))
    best_alpha: dict[bool, np.ndarray] = {}
    for setting in (False, True):
        group = [c for c in cases if c.prefetch == setting]
        if not group:
            continue
        column = _columns(group)
        a = column("compute_s") + hs * column("shaped_bytes") + hu * column("unshaped_bytes")
        comm = column("comm_s")
        hide = np.maximum(0.0, comm - column("edge_s"))
        err = (np.log((a + comm - alpha * np.minimum(a, hide)) / column("measured_s")) ** 2).sum(
            axis=3
        )  # (hs, hu, alpha)
        best_alpha[setting] = err.argmin(axis=2)
        score += err.min(axis=2)
    i, j = np.unravel_index(int(score.argmin()), score.shape)
    alphas = {s: float(alpha_grid[int(idx[i, j])]) for s, idx in best_alpha.items()}
    default = next(iter(alphas.values()), 1.0)
    return Fit(
        h_shaped=float(grid[i]),
        h_unshaped=float(grid[j]) if unshaped_seen else None,
        alpha={False: alphas.get(False, default), True: alphas.get(True, default)},
        rms_log_error=math.sqrt(float(score[i, j]) / len(cases)),
    )
