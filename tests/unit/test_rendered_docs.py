"""Figures are written once: README.md, BENCHMARKS.md, docs/ and the model cards show what docs/bench/*.json and
the code say, and a hand edit or a new JSON that was not re-rendered fails here, naming the file and the block.

The references are independent of the renderer: ratios and loss differences are recomputed from the raw
fields of the JSON (bytes sent, per-seed final losses), and the checkpoint's files from ``qaccel.checkpoint``.
Fast: no training, no network; the whole repository renders in a few seconds.
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
from pathlib import Path

import pytest

from qaccel.bench.docs_render import main, render_all, render_text, stale_blocks

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "docs" / "bench"


def _copy_repo(tmp_path: Path) -> Path:
    """The documents and the benchmark JSON in a scratch root, to edit without touching the checkout."""
    for name in ("README.md", "BENCHMARKS.md"):
        shutil.copy(REPO / name, tmp_path / name)
    shutil.copytree(BENCH, tmp_path / "docs" / "bench", ignore=shutil.ignore_patterns("*.png"))
    for path in (REPO / "docs").glob("*.md"):
        shutil.copy(path, tmp_path / "docs" / path.name)
    shutil.copytree(REPO / "model_cards", tmp_path / "model_cards")
    return tmp_path


def _blocks(text: str) -> list[str]:
    return re.findall(r"^<!-- rendered: (\S+) from ", text, re.MULTILINE)


def _block(text: str, spec: str) -> str:
    begin = text.index(f"<!-- rendered: {spec} from ")
    return text[begin : text.index(f"<!-- end rendered: {spec} -->", begin)]


def _bench(name: str) -> dict:
    return json.loads((BENCH / f"{name}.json").read_text())


def test_every_rendered_block_is_fresh():
    stale = stale_blocks(REPO)
    assert not stale, "stale rendered blocks:\n" + "\n".join(map(str, stale))


def test_the_documents_render_what_the_issue_names():
    readme, benchmarks = (REPO / "README.md").read_text(), (REPO / "BENCHMARKS.md").read_text()
    assert {"headline", "demo"} <= set(_blocks(readme))
    expected = {"e2e", "e2e-nodes", "project", "quant", "comm-qsdp", "comm-onebit", "lowbit-bytes", "presets", "e2e-goals",
                "e2e-fair-goals", "e2e-table(e2e_fair)", "e2e-table(e2e_overlap)", "convergence-table(convergence_hsdp)",
                "phases", "lowbit-loss", "minilm-lowbit"}  # fmt: skip
    assert expected <= set(_blocks(benchmarks))
    assert _blocks((REPO / "docs" / "export.md").read_text()) == ["checkpoint-files"]
    for card in ("gpt2-124m-lowbit", "gpt2-124m-w4g4", "minilm-finetune"):
        assert any(b.startswith("presets(") for b in _blocks((REPO / "model_cards" / f"{card}.md").read_text())), card


def test_readme_headline_figures_are_the_json_bytes():
    rows = {r["method"]: r for r in _bench("comm")["qsdp"]["rows"]}
    fp32 = rows["FSDP fp32"]["sent_bytes_per_step"]
    w8, w4 = (rows[m]["sent_bytes_per_step"] / fp32 for m in ("QSDP W8G8", "QSDP W4G4"))
    onebit = {r["method"]: r for r in _bench("comm")["onebit"]["rows"]}
    zo_share = onebit["DDP AdamW fp32"]["sent_bytes_per_step"] / onebit["0/1 Adam"]["sent_bytes_per_step"]
    headline = _block((REPO / "README.md").read_text(), "headline")
    assert f"QSDP W8G8 **{w8:.3f}x** of FSDP2 fp32, W4G4 **{w4:.3f}x**" in headline
    assert f"0/1 Adam **1/{zo_share:.0f}** of DDP AdamW's bytes" in headline
    demo = _bench("demo")["runs"]
    table = _block((REPO / "README.md").read_text(), "demo")
    for name, run in demo.items():
        assert re.search(rf"^{re.escape(name)}\s+{run['steps']}\s.*\s{run['wire_bytes_total'] / 1e6:.1f}\s", table, re.MULTILINE), name


def _pct_from_seeds(name: str, task: str, method: str) -> float:
    """The loss difference from the per-seed final losses, not from the study's own summary."""
    study = _bench(name)["tasks"][task]
    mean = statistics.fmean(study["methods"][method]["summary"]["final_eval_loss"])
    base = statistics.fmean(study["methods"][study["baseline"]]["summary"]["final_eval_loss"])
    return (mean / base - 1) * 100


def test_presets_table_is_the_json_and_covers_every_preset():
    from qaccel.bench._docs_figures import PRESET_FIGURES
    from qaccel.fsdp.config import PRESETS

    assert set(PRESET_FIGURES) == set(PRESETS), "a new preset needs its recorded figures in PRESET_FIGURES"
    rows = {r["method"]: r["sent_bytes_per_step"] for r in _bench("comm_qsdp_lowbit")["qsdp"]["rows"]}
    table = _block((REPO / "BENCHMARKS.md").read_text(), "presets")
    line = next(row for row in table.splitlines() if row.startswith("| `w3g2-nearest` |"))
    assert f"| {rows['QSDP W3G2'] / rows['FSDP fp32']:.4g}x |" in line
    assert f"| {_pct_from_seeds('convergence_lowbit_nearest', 'gpt2-tiny', 'w3g2-nr'):+.2f}% (5 seeds) |" in line
    assert f"| {_pct_from_seeds('convergence_lowbit_minilm', 'minilm-qsdp', 'w3g2-nr'):+.2f}% (5 seeds) |" in line
    low = _block((REPO / "BENCHMARKS.md").read_text(), "lowbit-loss")
    w2g2 = next(row for row in low.splitlines() if row.startswith("| W2G2 |")).split(" | ")
    assert w2g2[1] == f"{_pct_from_seeds('convergence_lowbit', 'gpt2-tiny', 'w2g2'):+.2f}%"  # stochastic column
    assert w2g2[5] == f"{_pct_from_seeds('convergence_lowbit_nearest', 'gpt2-tiny', 'w2g2-nr'):+.2f}%"  # nearest column
    assert all("BENCHMARKS.md" in entry["measured"] and not re.search(r"\d%", entry["measured"]) for entry in PRESETS.values())


def test_checkpoint_table_is_the_layout_and_written_once():
    import qaccel.checkpoint as checkpoint

    names = [getattr(checkpoint, n) for n in checkpoint.__all__ if n.endswith(("_FILE", "_DIR"))]
    assert len(names) >= 7
    table = _block((REPO / "docs" / "export.md").read_text(), "checkpoint-files")
    for name in names:
        assert f"`{name}`" in table or f"`{name}/`" in table, f"docs/export.md's checkpoint table misses {name}"
    repeats = [p.name for p in (REPO / "docs").glob("*.md") if "| entry | written by | content |" in p.read_text()]
    assert repeats == ["export.md"], f"the checkpoint table is repeated in {repeats}; link to docs/export.md instead"


def test_a_hand_edit_inside_a_block_is_named(tmp_path):
    root = _copy_repo(tmp_path)
    readme = root / "README.md"
    text = readme.read_text()
    edited = text.replace(_block(text, "headline"), _block(text, "headline").replace("| `qaccel bench quant` |", "| `qaccel bench quant` (fast) |"))
    assert edited != text
    readme.write_text(edited)
    assert [(s.document, s.spec) for s in stale_blocks(root)] == [("README.md", "headline")]
    assert main(["--check", "--root", str(root)]) == 1
    assert main(["--root", str(root)]) == 0 and readme.read_text() == text  # re-rendering restores the figure


def test_a_new_json_without_re_rendering_is_named_and_rendering_takes_it(tmp_path):
    root = _copy_repo(tmp_path)
    path = root / "docs" / "bench" / "comm.json"
    report = json.loads(path.read_text())
    row = next(r for r in report["qsdp"]["rows"] if r["method"] == "QSDP W8G8")
    row["sent_bytes_per_step"], row["ratio_vs_baseline"] = 200_000_000, 0.2995
    path.write_text(json.dumps(report))
    stale = {(s.document, s.spec) for s in stale_blocks(root)}
    assert {("README.md", "headline"), ("BENCHMARKS.md", "comm-qsdp"), ("BENCHMARKS.md", "presets")} <= stale
    assert render_all(root)
    assert "QSDP W8G8 **0.299x** of FSDP2 fp32" in (root / "README.md").read_text()
    assert "| 200,000,000 | **0.2995** |" in (root / "BENCHMARKS.md").read_text()
    assert stale_blocks(root) == []


def test_bad_markers_are_refused_with_the_block_named():
    with pytest.raises(ValueError, match=r"doc.md: rendered block 'nope': unknown renderer; known: .*headline"):
        render_text("<!-- rendered: nope from x -->\n<!-- end rendered: nope -->", sources=None, where="doc.md")
    with pytest.raises(ValueError, match=r"rendered block 'demo' ends with 'end rendered: headline'"):
        render_text("<!-- rendered: demo from x -->\n<!-- end rendered: headline -->", sources=None, where="doc.md")
    with pytest.raises(ValueError, match=r"presets\(w9g9\): unknown preset; choose from w8g8"):
        from qaccel.bench._docs_blocks import Sources

        render_text("<!-- rendered: presets(w9g9) from x -->\n<!-- end rendered: presets(w9g9) -->", Sources(REPO), "doc.md")


def test_a_root_without_benchmarks_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--check", "--root", str(tmp_path)])
    assert exc.value.code == 2 and "no docs/bench/ folder" in capsys.readouterr().err
