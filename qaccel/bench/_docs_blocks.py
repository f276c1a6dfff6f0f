"""The renderers behind ``docs_render``'s marked blocks: one per table a document shows, over its sources.

Each renderer reads the JSON a benchmark wrote (through :class:`Sources`) or the code that defines a name,
and formats it; where a benchmark already renders its report (``render_markdown``, ``print_table``) the
block is that output, so a document and ``--markdown`` can never disagree.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import _docs_gpu

__all__ = ["Sources", "Block", "BLOCKS", "qsdp_rows"]


class Sources:
    """The repository's benchmark JSON, read once per render (``root/docs/bench/NAME.json``)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._cache: dict[str, dict] = {}

    def json(self, name: str) -> dict:
        """``docs/bench/{name}.json``, parsed.

        Raises:
            ValueError: the file is missing or not JSON.
        """
        if name not in self._cache:
            path = self.root / "docs" / "bench" / f"{name}.json"
            try:
                self._cache[name] = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"docs/bench/{name}.json: cannot read it ({exc})") from exc
        return self._cache[name]


@dataclass(frozen=True)
class Block:
    """A renderer: the files it reads (for the begin marker) and the Markdown it makes of them."""

    sources: Callable[[tuple[str, ...]], tuple[str, ...]]
    render: Callable[[Sources, tuple[str, ...]], str]


def _bench(*names: str) -> Callable[[tuple[str, ...]], tuple[str, ...]]:
    return lambda args: tuple(f"docs/bench/{n}.json" for n in names)


def _report_block(name: str, module: str) -> Block:
    """A whole section a bench command already renders from its JSON (``--markdown``), image included."""

    def render(src: Sources, args: tuple[str, ...]) -> str:
        from importlib import import_module

        return import_module(f"qaccel.bench.{module}").render_markdown(src.json(name), image=f"docs/bench/{name}.png")

    return Block(_bench(name), render)


def _goals_block(name: str) -> Block:
    """The goals table of an e2e run: the ``### Goals`` part of the report ``qaccel bench e2e`` renders."""

    def render(src: Sources, args: tuple[str, ...]) -> str:
        from ._e2e_report import render_markdown

        text = render_markdown(src.json(name))
        goals = text.split("### Goals\n\n", 1)[1]
        return goals.split("\n\n", 1)[0]

    return Block(_bench(name), render)


def _args_bench(args: tuple[str, ...]) -> tuple[str, ...]:
    return _bench(*args)(args)


def _one_arg(args: tuple[str, ...], block: str) -> str:
    if len(args) != 1:
        raise ValueError(f"rendered block '{block}' takes one argument, the JSON's name under docs/bench/ (got {len(args)})")
    return args[0]


def _e2e_table(src: Sources, args: tuple[str, ...]) -> str:
    """The measured rows of an e2e run, with the compute-only time of each job (``e2e-table(NAME)``)."""
    from ._e2e_report import fraction_cell, mb_cell, speedup_cells, step_cell

    report = src.json(_one_arg(args, "e2e-table"))
    lines = [
        "| configuration | at | step s (median [min, max]) | link MB/step/rank | link/meter | T_compute s | T_comm s | "
        "of full-overlap ideal | vs FSDP2 fp32 | vs FSDP2 fp32, true RS | vs DDP AdamW |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        if "step_s" not in r:
            continue
        lines.append(
            f"| {r['label']} | {r['bandwidth']} | {step_cell(r)} | {mb_cell(r['link_bytes_per_rank_step'])} | {r['link_over_meter']:.2f} | "
            f"{r['t_compute_s']:.2f} | {r['t_comm_s']:.2f} | {fraction_cell(r)} | "
            + speedup_cells(r, ("fsdp2-fp32", "fsdp2-fp32-a2a", "ddp-adamw"))
            + " |"
        )
    return "\n".join(lines)


_KINDS = ("onebit_momentum", "onebit_gradient", "sync", "local")


def _e2e_kinds(src: Sources, args: tuple[str, ...]) -> str:
    """1-bit steps by kind against their own ideal, over one or more e2e runs (``e2e-kinds(NAME,NAME)``)."""
    rows = [r for name in args for r in src.json(name)["results"] if "step_s" in r and r.get("per_kind")]
    lines = [
        "| configuration | at | kind | step s | T_compute s | T_comm s | step / ideal | step / T_compute |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind in _KINDS:
        for r in rows:
            k = r["per_kind"].get(kind)
            if k is None:
                continue
            step = k["seconds"]["median"]
            over = f"{k['over_ideal_full_overlap']:.2f}"
            # a step that sends nothing has T_compute as its ideal: say so in its own column
            cells = ("", over) if kind == "local" else (over, "")
            lines.append(
                f"| {r['label']} | {r['bandwidth']} | {kind} | {step:.2f} | {r['t_compute_s']:.2f} | {k['t_comm_s']:.2f} | {cells[0]} | {cells[1]} |"
            )
    return "\n".join(lines)


def _convergence_table(src: Sources, args: tuple[str, ...]) -> str:
    """A convergence study's tables as ``qaccel bench convergence --markdown`` renders them, headings dropped."""
    from ._convergence_report import markdown

    text = markdown(src.json(_one_arg(args, "convergence-table")))
    return "\n".join(line for line in text.strip("\n").splitlines() if not line.startswith("#### ")).strip("\n")


# -- codec, bytes and rounds -------------------------------------------------------------------------------
def _share(value: float) -> str:
    return f"{value:.2f}" if value >= 0.01 else f"{value:.3f}"


def _quant(src: Sources, args: tuple[str, ...]) -> str:
    report = src.json("quant")
    lines = [
        "| threads | backend | bits | quantize GB/s | dequantize GB/s | round trip GB/s | vs copy | vs reference |",
        "|---|---|---|---|---|---|---|---|",
    ]
    copies = []
    for key, setting in report["settings"].items():
        threads = key.rsplit("_", 1)[1]
        for backend in ("cpu", "reference"):
            for r in setting["backends"].get(backend, []):
                if backend == "reference" and r["bits"] != 8:
                    continue  # the reference's speed does not depend on the bit width; one row says it
                ref = r.get("roundtrip_vs_reference", 1.0)
                lines.append(
                    f"| {threads} | {backend} | {r['bits']} | {r['quantize_gbps']:.2f} | {r['dequantize_gbps']:.2f} | "
                    f"{r['roundtrip_gbps']:.2f} | {_share(r['roundtrip_vs_copy'])} | {ref:.0f}x |"
                )
        copies.append(f"{setting['copy']['gbps']:.1f} GB/s ({threads} thread{'s' if threads != '1' else ''})")
    goals = report["goals"]
    met = all(g["met"] for g in goals["by_setting"].values())
    lines += [
        "",
        f"Copy into a reused buffer: {', '.join(copies)}. Goal (C++ at least {goals['cpu_roundtrip_vs_reference']:g}x the "
        f"reference and at least {goals['cpu_roundtrip_vs_copy']:.0%} of copy bandwidth, on one and on all threads): "
        f"{'met' if met else '**missed**'}.",
    ]
    return "\n".join(lines)


def qsdp_rows(src: Sources, name: str = "comm") -> dict[str, dict]:
    """``qaccel bench comm --only qsdp`` rows by method label (``"QSDP W8G8"``, ``"FSDP fp32"``, ...)."""
    return {r["method"]: r for r in src.json(name)["qsdp"]["rows"]}


def _comm_qsdp(src: Sources, args: tuple[str, ...]) -> str:
    rows = qsdp_rows(src)
    goals = {"QSDP W8G8": "≤ 0.26", "QSDP W4G4": "≤ 0.135"}
    names = {"FSDP fp32": "FSDP2 fp32", "FSDP bf16": "FSDP2 bf16 (`param_dtype=reduce_dtype=bf16`)"}
    lines = ["| method | codec | bytes sent / step / rank | vs FSDP fp32 | goal |", "|---|---|---|---|---|"]
    for method, r in rows.items():
        codec = r["weight_codec"]
        how = "—" if codec is None else f"{codec['bits']} bit, bucket {codec['bucket_size']}, {codec['meta_dtype'].split('.')[-1].replace('float', 'fp').replace('bfp', 'bf')} metadata"
        ratio = f"{r['ratio_vs_baseline']:.3f}" if codec is None else f"**{r['ratio_vs_baseline']:.4f}**"
        lines.append(f"| {names.get(method, method)} | {how} | {r['sent_bytes_per_step']:,} | {ratio} | {goals.get(method, '')} |")
    return "\n".join(lines)


def _ratio_words(ratio: float) -> str:
    return f"1/{1 / ratio:.3g}" if ratio < 0.5 else f"{ratio:.3g}"


def _comm_onebit(src: Sources, args: tuple[str, ...]) -> str:
    section = src.json("comm")["onebit"]
    lines = [
        "| method | avg bytes sent / step | bytes vs AdamW | rounds | rounds vs AdamW | collective calls |",
        "|---|---|---|---|---|---|",
    ]
    for r in section["rows"]:
        method = r["method"].replace("(alpha=32678)", "α = 32678 (DeepSpeed's BERT config)").replace(" α", ", α").replace(" (α", ", α")
        ratio, rounds = r["ratio_vs_baseline"], r["rounds_ratio_vs_baseline"]
        bytes_cell = "1" if ratio == 1 else f"{ratio:.3g} ({_ratio_words(ratio)})"
        cells = [method, f"{r['sent_bytes_per_step']:,}", bytes_cell, f"{r['rounds']:,}", f"{rounds:.2f}" if rounds >= 0.995 else f"{rounds:.3f}", f"{r['collective_calls']:,}"]
        if r["method"] == "0/1 Adam":
            cells = [f"**{c}**" for c in cells[:5]] + cells[5:]
        lines.append("| " + " | ".join(cells) + " |")
    goal = section["goal"]
    lines += [
        "",
        f"Goal (0/1 Adam ≤ 1/{1 / goal['bytes_ratio_max']:.0f} of AdamW's bytes and ≤ {goal['rounds_ratio_max']:g} of its rounds): "
        f"{'met' if goal['met'] else '**missed**'}.",
    ]
    return "\n".join(lines)


def _lowbit_bytes(src: Sources, args: tuple[str, ...]) -> str:
    rows = {m.removeprefix("QSDP "): r for m, r in qsdp_rows(src, "comm_qsdp_lowbit").items() if m.startswith("QSDP ") and m != "QSDP W8G8"}
    cells = [f"**{r['ratio_vs_baseline']:.4f}**" if r["ratio_vs_baseline"] <= 0.1 else f"{r['ratio_vs_baseline']:.4f}" for r in rows.values()]
    return "\n".join(["| QSDP | " + " | ".join(rows) + " |", "|---" * (len(rows) + 1) + "|", "| of FSDP2 fp32's bytes | " + " | ".join(cells) + " |"])


def _demo(src: Sources, args: tuple[str, ...]) -> str:
    from .demo import print_table

    report = src.json("demo")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_table(report["runs"], report["link"])
    # the table only: print_table's closing notes are said in the README's prose
    table = out.getvalue().strip("\n").splitlines()[: 3 + len(report["runs"])]
    return "\n".join(["```", *table, "```"])


def _preset_sources(args: tuple[str, ...]) -> tuple[str, ...]:
    from ._docs_figures import PRESET_FIGURES

    wanted = args or tuple(PRESET_FIGURES)
    names = dict.fromkeys(cell[0] for p in wanted if p in PRESET_FIGURES for cell in PRESET_FIGURES[p].values())
    return _bench(*names)(args)


def _headline_sources(args: tuple[str, ...]) -> tuple[str, ...]:
    from ._docs_readme import HEADLINE_SOURCES

    return _bench(*HEADLINE_SOURCES)(args)


def _presets(src: Sources, args: tuple[str, ...]) -> str:
    from ._docs_figures import presets_table

    return presets_table(src, args)


def _headline(src: Sources, args: tuple[str, ...]) -> str:
    from ._docs_readme import headline_table

    return headline_table(src)


def _figures(function: str) -> Callable[[Sources, tuple[str, ...]], str]:
    def render(src: Sources, args: tuple[str, ...]) -> str:
        from . import _docs_figures

        return getattr(_docs_figures, function)(src)

    return render


def _lowbit_sources(args: tuple[str, ...]) -> tuple[str, ...]:
    from ._docs_figures import LOWBIT_SOURCES

    return _bench(*LOWBIT_SOURCES)(args)


def _checkpoint(src: Sources, args: tuple[str, ...]) -> str:
    from ._docs_figures import checkpoint_table

    return checkpoint_table()


BLOCKS: dict[str, Block] = {
    "e2e": _report_block("e2e", "_e2e_report"),
    "e2e-nodes": _report_block("e2e_2node", "_e2e_cluster_report"),
    "project": _report_block("project", "_project_report"),
    "e2e-fair-goals": _goals_block("e2e_fair"),
    "e2e-goals": _goals_block("e2e_goals"),
    "e2e-table": Block(_args_bench, _e2e_table),
    "e2e-kinds": Block(_args_bench, _e2e_kinds),
    "convergence-table": Block(_args_bench, _convergence_table),
    "quant": Block(_bench("quant"), _quant),
    "comm-qsdp": Block(_bench("comm"), _comm_qsdp),
    "comm-onebit": Block(_bench("comm"), _comm_onebit),
    "lowbit-bytes": Block(_bench("comm_qsdp_lowbit"), _lowbit_bytes),
    "demo": Block(_bench("demo"), _demo),
    "phases": Block(_bench("phases"), _figures("phases_table")),
    "lowbit-loss": Block(_lowbit_sources, _figures("lowbit_loss_table")),
    "minilm-lowbit": Block(_bench("convergence_lowbit_minilm"), _figures("minilm_lowbit_table")),
    "presets": Block(_preset_sources, _presets),
    "headline": Block(_headline_sources, _headline),
    "checkpoint-files": Block(lambda args: ("qaccel/checkpoint/_layout.py",), _checkpoint),
    "gpu-check": Block(_args_bench, _docs_gpu.render_gpu_check),
    "onebit-fused": Block(_args_bench, _docs_gpu.render_onebit_fused),
}
