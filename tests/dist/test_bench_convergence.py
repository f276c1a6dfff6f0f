"""``qaccel bench convergence --quick`` end to end on 2 gloo ranks: report shape, seeds, reproducibility.

The quick preset checks the pipeline, not convergence: a few steps per run, 2 seeds. What must hold
even then: every (task, method) ran every seed with finite losses, training from scratch lowered the
eval loss below the untrained model's, QSDP's noise follows the seed (two seeds differ), and
rerunning a seed reproduces the report's curve bit for bit.
"""

from __future__ import annotations

import json
import math
import statistics

import pytest

from qaccel.bench._convergence_run import train_seeds
from qaccel.bench._convergence_tasks import TASKS
from qaccel.bench._ranks import run_on_cpu_ranks
from qaccel.cli import main

# From random initialisation the first steps lower the loss from about ln(vocab) every time; a
# pretrained classifier's few quick steps at lr 1e-4 need not.
FROM_SCRATCH = ("gpt2-tiny", "bert-tiny")
SUMMARY_KEYS = {
    "final_eval_loss", "final_eval_loss_mean", "final_eval_loss_std", "diff_vs_baseline_pct",
    "diff_vs_baseline_in_baseline_std", "paired_diff_mean", "paired_diff_std", "goal_pct",
    "wire_bytes_per_step_per_rank", "verdict",
}  # fmt: skip


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory, monkeypatch_module):
    out = tmp_path_factory.mktemp("convergence")
    json_path, md_path = out / "c.json", out / "c.md"
    assert main(["bench", "convergence", "--quick", "--json", str(json_path), "--markdown", str(md_path)]) == 0
    return json.loads(json_path.read_text()), out


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("OMP_NUM_THREADS", "1")
    yield mp
    mp.undo()


def test_report_has_every_task_method_and_seed(quick_report):
    report, out = quick_report
    assert report["schema_version"] == 1 and report["benchmark"] == "convergence"
    assert report["seeds"] == [0, 1]
    assert report["task_order"] == list(TASKS) and set(report["tasks"]) == set(TASKS)
    assert {"cpu", "ranks", "torch"} <= set(report["machine"])
    assert report["commands"] == [f"qaccel bench convergence --quick --json {out / 'c.json'} --markdown {out / 'c.md'}"]
    assert (out / "c.png").stat().st_size > 10_000  # a real figure, not an empty canvas
    md = (out / "c.md").read_text()
    for name, task in report["tasks"].items():
        assert task["steps"] == TASKS[name].quick_steps
        assert task["method_order"] == [m.key for m in TASKS[name].methods] and set(task["methods"]) == set(task["method_order"])
        assert f"#### {name}" in md
        for key, method in task["methods"].items():
            assert method["label"] in md
            assert SUMMARY_KEYS <= set(method["summary"]), key
            runs = method["runs"]
            assert [run["seed"] for run in runs] == [0, 1]
            for run in runs:
                assert len(run["train_loss"]) == task["steps"]
                assert all(math.isfinite(x) for x in run["train_loss"])
                steps = [point["step"] for point in run["eval"]]
                assert steps[0] == 0 and steps[-1] == task["steps"]
                losses = [point["eval_loss"] for point in run["eval"]]
                assert all(math.isfinite(x) for x in losses)
                if name in FROM_SCRATCH:  # training helped: the final eval loss is below the untrained model's
                    assert losses[-1] < losses[0], (name, key, run["seed"], losses)
                else:  # the weights moved (3 fine-tuning steps move the loss less than 16 examples' eval noise)
                    assert losses[-1] != losses[0], (name, key, run["seed"], losses)
                assert run["sent_bytes"] > 0
            # mean ± std recomputed independently from the per-seed finals
            finals = [run["eval"][-1]["eval_loss"] for run in runs]
            assert method["summary"]["final_eval_loss_mean"] == pytest.approx(statistics.fmean(finals), rel=1e-12)
            assert method["summary"]["final_eval_loss_std"] == pytest.approx(statistics.stdev(finals), rel=1e-12)
            if name == "minilm-finetune":
                assert all(0.0 <= run["eval"][-1]["eval_accuracy"] <= 1.0 for run in runs)
        base = task["methods"][task["baseline"]]["summary"]["final_eval_loss_mean"]
        for method in task["methods"].values():
            expected = 100.0 * (method["summary"]["final_eval_loss_mean"] - base) / base
            assert method["summary"]["diff_vs_baseline_pct"] == pytest.approx(expected, abs=1e-9)


def test_compression_sends_fewer_bytes_than_its_baseline(quick_report):
    gpt = quick_report[0]["tasks"]["gpt2-tiny"]["methods"]
    fsdp = gpt["fsdp2"]["summary"]["wire_bytes_per_step_per_rank"]
    # 8-bit codes plus metadata: between 1/4 and 1/2 of fp32; 4-bit: between 1/8 and 1/4
    assert fsdp / 4 < gpt["w8g8"]["summary"]["wire_bytes_per_step_per_rank"] < fsdp / 2
    assert fsdp / 8 < gpt["w4g4"]["summary"]["wire_bytes_per_step_per_rank"] < fsdp / 4


def test_seeds_differ_and_a_repeated_seed_reproduces_bit_for_bit(quick_report):
    report, _ = quick_report
    task = report["tasks"]["gpt2-tiny"]
    runs = task["methods"]["w4g4"]["runs"]
    assert runs[0]["train_loss"] != runs[1]["train_loss"]
    method = next(m for m in TASKS["gpt2-tiny"].methods if m.key == "w4g4")
    job = ("gpt2-tiny", method, [0], task["steps"], task["eval_every"], task["eval_examples"])
    again = run_on_cpu_ranks(train_seeds, 2, [job], "repeat seed 0")
    rerun = again[0][0]["runs"][0]
    assert rerun["train_loss"] == runs[0]["train_loss"]
    assert rerun["eval"] == runs[0]["eval"]
    # rank 1 computed the same all-reduced numbers
    assert again[1][0]["runs"][0]["train_loss"] == rerun["train_loss"]


def test_merge_renders_without_training_and_refuses_a_task_twice(quick_report, tmp_path):
    report, out = quick_report
    assert main(["bench", "convergence", "--merge", str(out / "c.json"), "--markdown", str(tmp_path / "m.md"), "--plot", str(tmp_path / "m.png")]) == 0
    assert (tmp_path / "m.md").read_text() == (out / "c.md").read_text()
    with pytest.raises(ValueError, match=r"task\(s\) \['bert-tiny', 'gpt2-tiny', 'minilm-finetune'\] already"):
        main(["bench", "convergence", "--merge", str(out / "c.json"), str(out / "c.json")])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tasks", "gpt3"], "unknown task 'gpt3'; choose from gpt2-tiny, bert-tiny, minilm-finetune"),
        (["--methods", "w2g2"], r"--methods: unknown \['w2g2'\]"),
        (["--seeds", "0"], "--seeds=0: must be >= 1"),
        (["--long-only"], "--long-only: needs --long-steps N"),
    ],
)
def test_bad_arguments_name_the_value(argv, message):
    with pytest.raises(ValueError, match=message):
        main(["bench", "convergence", *argv])
