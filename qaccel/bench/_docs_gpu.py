"""The GPU check's reports as document tables (``gpu-check(NAME,...)`` and ``onebit-fused(NAME)`` blocks).

``scripts/gpu_check.sh`` writes one JSON per run (docs/gpu_runbook.md, "Reading the JSON"). A later
run given after an earlier one replaces the sections it ran, so a rerun of the sections that failed
shows next to the first run's other sections, each row naming the file it came from.
"""

from __future__ import annotations

from typing import Any

__all__ = ["render_gpu_check", "render_onebit_fused"]


def _latest_sections(reports: list[tuple[str, dict]]) -> dict[str, tuple[str, dict]]:
    sections: dict[str, tuple[str, dict]] = {}
    for name, report in reports:
        for section in report["sections"]:
            if section in report:
                sections[section] = (name, report[section])
    return sections


def _verdict(result: dict) -> str:
    if "error" in result:
        return "**error**"
    if "skipped" in result:
        return "skipped"
    if "ok" not in result:
        return "measured"
    return "passed" if result["ok"] else "**failed**"


def _zoadam_figures(result: dict) -> str:
    warmup = max(step.get("moments_vs_torch_adam", 0.0) for step in result["warmup_vs_torch_adam"]["steps"])
    kinds = result["all_step_kinds"]
    return (f"moments vs `torch.optim.Adam` rel. {warmup:.1e}; {len(kinds['kinds'])} steps of every kind vs a plain "
            f"loop rel. {kinds['weights_vs_plain_loop']:.1e}; host syncs in `step()`: {len(kinds['host_syncs'])}")  # fmt: skip


def _fsdp_figures(result: dict) -> str:
    variants = [name for name in ("fp32", "bf16") if result.get(name, {}).get("identical")]
    comms = result.get("comms_over_nccl", {})
    return (f"{', '.join(variants) or 'no variant'} identical to stock FSDP2 (world size 1: no collective is issued); "
            f"QSDP all-gather / reduce-scatter over NCCL: {len(comms.get('cases', []))} cases equal the reference")  # fmt: skip


def _figures(section: str, result: dict) -> str:
    """One line of what a section measured, for the verdict table."""
    if "error" in result:
        return result["error"].strip().splitlines()[-1][:160]
    if "skipped" in result:
        return str(result["skipped"])[:160]
    if section == "bit_identical":
        return f"{result['cases']} cases, {result['mismatches']} mismatches"
    if section in ("payloads", "payloads_rotated"):
        return f"{len(result['cases'])} layouts, {len(result['failures'])} differing"
    if section == "cross_backend":
        return f"C++ against CUDA: {result['cases']} cases, {len(result['failures'])} differing"
    if section == "fsdp_smoke":
        return _fsdp_figures(result)
    if section == "zero_one_adam":
        return _zoadam_figures(result)
    if section == "bandwidth":
        return f"copy {result['copy_gbps']:.0f} GB/s = {result['copy_vs_peak']:.2f} of the {result['peak_gbps']:.0f} GB/s peak"
    if section == "fp64":
        return str(result.get("summary", ""))[:160]
    return ""


def _bandwidth_table(result: dict) -> list[str]:
    lines = ["| input | bits | bucket | quantize GB/s | of peak | dequantize GB/s | of peak |", "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['input']} | {row['bits']} | {row['bucket_size']} | {row['quantize_gbps']:.0f} | "
                     f"{row['quantize_vs_peak']:.2f} | {row['dequantize_gbps']:.0f} | {row['dequantize_vs_peak']:.2f} |")  # fmt: skip
    for name in ("sign_pack", "sign_unpack"):
        if name in result:
            lines.append(f"| fp32 | 1 (`{name}`) | — | {result[name]['gbps']:.0f} | {result[name]['vs_peak']:.2f} | | |")
    return lines


def render_gpu_check(src: Any, args: tuple[str, ...]) -> str:
    """The verdicts of one or more ``gpu_check`` runs (later files override earlier ones per section), and bandwidth."""
    reports = [(name, src.json(name)) for name in args]
    env = reports[0][1]["environment"]
    build = reports[0][1].get("build", {})
    lines = [
        f"{env['device']} (sm_{''.join(map(str, env['capability']))}), torch {env['torch']}, CUDA {env['torch_cuda']}, "
        f"Python {env['python']}; kernels JIT-built in {build.get('seconds', 0):.0f} s.",
        "",
        "| section | verdict | what it showed | report |",
        "|---|---|---|---|",
    ]
    sections = _latest_sections(reports)
    for section, (name, result) in sections.items():
        lines.append(f"| `{section}` | {_verdict(result)} | {_figures(section, result)} | `{name}.json` |")
    if "bandwidth" in sections:
        lines += ["", *_bandwidth_table(sections["bandwidth"][1])]
    return "\n".join(lines)


def render_onebit_fused(src: Any, args: tuple[str, ...]) -> str:
    """The fused 1-bit error-feedback ops against the unfused sequence, per backend, from a ``bench quant`` JSON."""
    (name,) = args
    lines = ["| setting | backend | values | encode fused / unfused ns per value | speed-up | server fused / unfused | speed-up |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for setting, measured in src.json(name)["settings"].items():
        for backend, row in measured.get("onebit", {}).items():
            lines.append(f"| {setting} | {backend} | {row['numel']:,} | {row['encode_fused_ns_per_value']:.4f} / "
                         f"{row['encode_unfused_ns_per_value']:.4f} | {row['encode_speedup']:.2f}x | "
                         f"{row['server_fused_ns_per_value']:.4f} / {row['server_unfused_ns_per_value']:.4f} | "
                         f"{row['server_speedup']:.2f}x |")  # fmt: skip
    return "\n".join(lines)
