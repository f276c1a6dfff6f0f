"""Calibration of ``qaccel bench project``'s cost model on the simulated cluster ``qaccel bench e2e`` measured.

Three constants are fitted there, on the simulated cluster only: the host's transport cost per byte ``h``
(on a shaped and on an unshaped link) and the overlap efficiency ``alpha`` with and without prefetch; every
measured configuration gets its prediction, its relative error and its leave-one-out error.
"""

from __future__ import annotations

import numpy as np

from ._e2e_methods import format_rate
from ._project_bytes import METHODS, Collective, ModelShapes, policy_dtypes, step_collectives
from ._project_inputs import COMPUTE_DTYPES, Measured
from ._project_model import CalibrationCase, CodecRates, Fit, Link, Platform, fit_calibration, step_time

__all__ = ["calibrate", "sim_platform", "GOAL_RELATIVE_ERROR", "H_GRID", "ALPHA_GRID"]

GOAL_RELATIVE_ERROR = 0.15
H_GRID = tuple(i * 0.25e-9 for i in range(0, 81))  # 0 .. 20 ns per byte, for each of the two host costs
ALPHA_GRID = tuple(i / 100 for i in range(0, 101))


def sim_platform(m: Measured, codec: CodecRates, cores: int, fit: Fit | None = None) -> Platform:
    """The simulated cluster as ``qaccel bench e2e`` shapes it (``_e2e_netns``), with the fitted constants.

    One node: every rank's traffic crosses the namespace's one loopback, shaped to the rate in both
    directions together (a shared bus). Two nodes: each node's loopback is unshaped (its cost is the host's
    transport time) and the veth pair between them is shaped at each end, so each direction has the rate.
    """
    shaped = fit.h_shaped if fit else 0.0
    unshaped = (fit.h_unshaped or 0.0) if fit else 0.0
    rate = None if m.rate_bits is None else m.rate_bits / 8
    h_rate = shaped if rate is not None else unshaped
    if m.nodes == 1:
        intra, inter = Link("bus", rate, host_s_per_byte=h_rate), None
    else:
        intra, inter = Link("bus", None, host_s_per_byte=unshaped), Link("nic", rate, host_s_per_byte=h_rate)
    share = max(1.0, m.nodes * m.per_node / max(1, cores))
    return Platform(intra, inter, codec, codec_share=share, overlap=fit.alpha if fit else {True: 0.0, False: 0.0})


def _case(m: Measured, collectives: list[Collective], platform: Platform) -> CalibrationCase:
    """The fit's view of one configuration: its bytes split by whether their link is shaped."""
    terms = step_time(collectives, platform, compute_s=m.compute_s, prefetch=m.prefetch)
    inter = terms.bytes_per_step["machine_inter"]
    by_link = [(platform.intra, terms.bytes_per_step["machine"] - inter), (platform.inter, inter)]
    shaped = sum(n for link, n in by_link if link is not None and link.rate_bytes_per_s is not None)
    unshaped = sum(n for link, n in by_link if link is not None and link.rate_bytes_per_s is None)
    return CalibrationCase(
        terms.compute_s + terms.codec_s, shaped, unshaped, terms.comm_s, terms.edge_s, m.prefetch, m.step_s
    )


def _predicted_bytes(m: Measured, collectives: list[Collective]) -> dict[str, float]:
    """Bytes per step the model puts where the bench counts them (the whole job, all directions)."""
    total = {"link": 0.0, "inter_node": 0.0, "intra_node": 0.0}
    for c in collectives:
        total["link"] += c.count * c.traffic.machine
        total["inter_node"] += c.count * c.traffic.inter_nic * m.nodes
        total["intra_node"] += c.count * c.traffic.intra_bus * m.nodes
    return total if m.nodes > 1 else {"link": total["link"]}


def calibrate(measured: list[Measured], shapes: dict[str, ModelShapes], codec: CodecRates, cores: int) -> dict:
    """Fit ``h`` and ``alpha`` on every measured configuration; predictions, errors and leave-one-out errors."""
    collectives = []
    for m in measured:
        dtype = COMPUTE_DTYPES[m.compute]
        param, reduce = policy_dtypes(METHODS[m.method], dtype, accelerate=False)
        collectives.append(step_collectives(shapes[m.source], METHODS[m.method], nodes=m.nodes, per_node=m.per_node,
                                            param_dtype=param, reduce_dtype=reduce, backend="gloo"))  # fmt: skip
    cases = [_case(m, cs, sim_platform(m, codec, cores)) for m, cs in zip(measured, collectives, strict=True)]
    fit = fit_calibration(cases, h_grid=H_GRID, alpha_grid=ALPHA_GRID)
    rows = []
    for i, (m, cs, case) in enumerate(zip(measured, collectives, cases, strict=True)):
        terms = step_time(cs, sim_platform(m, codec, cores, fit), compute_s=m.compute_s, prefetch=m.prefetch)
        rest = cases[:i] + cases[i + 1 :]
        loo = None
        if rest and any(c.prefetch == m.prefetch for c in rest):
            loo = fit_calibration(rest, h_grid=H_GRID, alpha_grid=ALPHA_GRID).predict(case)
        predicted_bytes = _predicted_bytes(m, cs)
        low, high = m.step_min_s, m.step_max_s
        rows.append({
            "source": m.source, "label": m.label, "method": m.method, "compute": m.compute, "prefetch": m.prefetch,
            "bandwidth": format_rate(m.rate_bits), "rate_bits_per_s": m.rate_bits, "nodes": m.nodes, "per_node": m.per_node,
            "measured_s": m.step_s, "measured_min_s": low, "measured_max_s": high, "compute_only_s": m.compute_s,
            "predicted_s": terms.total_s, "relative_error": terms.total_s / m.step_s - 1,
            "within_goal": abs(terms.total_s / m.step_s - 1) <= GOAL_RELATIVE_ERROR,
            "within_measured_range": (low is not None and high is not None and low <= terms.total_s <= high),
            "loo_predicted_s": loo, "loo_relative_error": None if loo is None else loo / m.step_s - 1,
            "terms": {"codec_s": terms.codec_s, "host_s": terms.host_s, "comm_s": terms.comm_s, "edge_s": terms.edge_s,
                      "link_busy_s": terms.link_busy_s},
            "predicted_bytes_per_step": predicted_bytes,
            "measured_bytes_per_step": m.link_bytes,
        })  # fmt: skip
    errors = [abs(r["relative_error"]) for r in rows]
    loo_errors = [abs(r["loo_relative_error"]) for r in rows if r["loo_relative_error"] is not None]
    return {
        "fitted": {"host_ns_per_byte_shaped": fit.h_shaped * 1e9,
                   "host_ns_per_byte_unshaped": None if fit.h_unshaped is None else fit.h_unshaped * 1e9,
                   "alpha_prefetch_off": fit.alpha[False], "alpha_prefetch_on": fit.alpha[True], "rms_log_error": fit.rms_log_error},
        "rows": rows,
        "summary": {"configurations": len(rows), "within_goal": sum(r["within_goal"] for r in rows),
                    "goal_relative_error": GOAL_RELATIVE_ERROR,
                    "within_measured_range": sum(r["within_measured_range"] for r in rows),
                    "max_abs_relative_error": max(errors) if errors else None,
                    "median_abs_relative_error": float(np.median(errors)) if errors else None,
                    "loo_within_goal": sum(e <= GOAL_RELATIVE_ERROR for e in loo_errors),
                    "loo_max_abs_relative_error": max(loo_errors) if loo_errors else None,
                    "loo_median_abs_relative_error": float(np.median(loo_errors)) if loo_errors else None},
    }  # fmt: skip

